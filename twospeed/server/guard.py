"""GuardMiddleware: the API key, the body-size limit, and no new work while draining — before any route runs.

Pure ASGI, so streaming responses and disconnects pass through untouched.

With --api-key, every path needs the key, including /openapi.json and the docs pages (they reveal the
API) and paths that do not exist (a 401 tells a stranger less than a 404); `OPEN_PATHS` is the one table
of exceptions: a path prefix and the ServerConfig flag that opens it. A new router is keyed without
touching this file, and joins the table only to offer an opener.

A body larger than max_body_bytes gets 413 before it is read: at once from its Content-Length, or as
soon as a chunked body grows past the limit.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from twospeed.server.config import ServerConfig
from twospeed.server.errors import error_body

OPEN_PATHS: list[tuple[str, str]] = [  # (path prefix, the ServerConfig flag that opens it without the key)
    ("/health", "metrics_public"),
    ("/metrics", "metrics_public"),
    ("/openapi.json", "docs_public"),
    ("/docs", "docs_public"),
    ("/redoc", "docs_public"),
]


def needs_key(path: str, config: ServerConfig) -> bool:
    """Whether `path` needs the API key under this config (a prefix matches whole path segments)."""
    for prefix, opener in OPEN_PATHS:
        if path == prefix or path.startswith(prefix + "/"):
            return not getattr(config, opener)
    return True


class GuardMiddleware:
    """API key (OPEN_PATHS), body-size limit (413), and 503 for new work while the server drains."""

    def __init__(self, app, get_state, config: ServerConfig):
        self.app = app
        self.get_state = get_state
        self.config = config
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or ())
        if self._key is not None and needs_key(path, self.config):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                response = JSONResponse(error_body("missing or incorrect API key (send Authorization: Bearer KEY)",
                                                   "authentication_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        state = self.get_state()
        if state is not None and state.draining and scope.get("method") == "POST":
            response = JSONResponse(error_body("the server is shutting down", "service_unavailable"), status_code=503,
                                    headers={"Connection": "close"})
            return await response(scope, receive, send)
        limit = self.config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._too_large(int(length), scope, receive, send)
        if length is None and b"chunked" in headers.get(b"transfer-encoding", b""):
            receive = await self._buffered(receive, limit)
            if receive is None:
                return await self._too_large(None, scope, None, send)
        await self.app(scope, receive, send)

    async def _buffered(self, receive, limit: int):
        """Read a chunked body up to `limit` bytes; a receive that replays it, or None if it is larger."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > limit:
                return None
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return chunks.pop(0) if chunks else await receive()

        return replay

    async def _too_large(self, size: int | None, scope, receive, send) -> None:
        limit = self.config.max_body_bytes
        got = f"is {size:,} bytes" if size is not None else "is larger than that"
        response = JSONResponse(error_body(f"the request body {got}; at most {limit:,} bytes are accepted "
                                           "(--max-body-bytes)", "invalid_request_error", None, "request_too_large"),
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)
