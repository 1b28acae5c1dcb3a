"""OpenAI-style errors: the APIError handlers raise, its JSON body, and the app's exception handlers.

Every error a client sees, whatever raised it (a handler, pydantic, a route that does not exist, a bug),
is `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("twospeed.server")


class UnsupportedValue(ValueError):
    """A field OpenAI defines, set to a value twospeed does not implement (or a value its rules refuse)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class APIError(Exception):
    """An error the client gets as an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


_ERROR_SCHEMA = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "object"}}}}}
ERROR_RESPONSES = {code: {"description": desc, "content": _ERROR_SCHEMA} for code, desc in (
    (400, "invalid request"), (401, "missing or wrong API key"), (429, "waiting queue full; see Retry-After"),
    (503, "shutting down or not ready"))}


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a request can raise to its OpenAI-style response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(UnsupportedValue)
    async def _unsupported(request: Request, e: UnsupportedValue):
        return error_response(APIError(400, str(e), param=e.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        message = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(e.status_code, message, type_, headers=getattr(e, "headers", None)))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, e: ClientDisconnect):
        # The client left before its body was read: nothing to answer and nothing wrong here (nginx's 499)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))


_UNION_TAG = re.compile(r"[\[\]-]|^(str|int|float|bool|list|dict|none|json-or-python)$")


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one OpenAI-style message; param is the field's path (messages.0.role)."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})".replace(" ()", ""))

    def path(err: dict) -> str:
        # Drop "body" and the tags pydantic adds for union members ("str", "list[str]", ...).
        return ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_TAG.search(str(p)))

    param = path(first)
    if not param:
        if first.get("type") == "missing":
            return APIError(400, "the request body is missing (expected a JSON object)")
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    same = list(dict.fromkeys(err.get("msg", "") for err in errors if path(err) == param))
    message = f"{param}: {' or '.join(same[:4])}"
    others = len({path(err) for err in errors} - {param})
    if others:
        message += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    return APIError(400, message, param=param)
