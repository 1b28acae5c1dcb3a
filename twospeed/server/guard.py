"""GuardMiddleware: the API key, the body's size and type, and no new work while draining — before any route runs.

Pure ASGI, so streaming responses and disconnects pass through untouched.

With --api-key, every path needs the key, including /openapi.json and the docs pages (they reveal the
API) and paths that do not exist (a 401 tells a stranger less than a 404); `OPEN_PATHS` is the one table
of exceptions: a path prefix and the ServerConfig flag that opens it. A new router is keyed without
touching this file, and joins the table only to offer an opener.

The key goes as `Authorization: Bearer KEY`, or, on the dashboard's GET requests only, as the password of HTTP
Basic auth (any user name): a browser cannot send a Bearer header when it opens /dashboard, but it asks for a
Basic password when the 401 says so (BROWSER_PATHS get that challenge) and then sends it with every request of
the page. Browsers resend cached Basic credentials on cross-site requests too, so Basic never opens the API.

Cross-origin policy: the server sends no CORS headers, so a web page of another origin can read nothing, and
every POST body must be JSON (`application/json`, or a `+json` type; none at all is taken as JSON): the bodies
a page can send cross-site without a preflight (text/plain, form-urlencoded, multipart) get 415 before they
are read, and the preflight a JSON body needs is never granted. So a keyless server on localhost cannot be
driven by a web page.

A body larger than max_body_bytes gets 413 before it is read: at once from its Content-Length, or as
soon as a chunked body grows past the limit. A request with both Content-Length and Transfer-Encoding is a
400 (RFC 9112 calls it an error; a guard trusting one header while the parser follows the other is how a 20 MB
body passed a 10-byte Content-Length).
"""

from __future__ import annotations

import base64
import hmac

from fastapi.responses import JSONResponse

from twospeed.server.config import ServerConfig
from twospeed.server.errors import error_body

OPEN_PATHS: list[tuple[str, str]] = [  # (path prefix, the ServerConfig flag that opens it without the key)
    ("/health", "metrics_public"),
    ("/metrics", "metrics_public"),
    ("/dashboard", "metrics_public"),  # the page, its data, the clock: what /metrics shows, drawn
    ("/openapi.json", "docs_public"),
    ("/docs", "docs_public"),
    ("/redoc", "docs_public"),
]


BROWSER_PATHS = ("/dashboard",)  # a 401 here asks the browser for a Basic password (the key)


def _matches(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def _route_path(scope) -> str:
    """The path the routes see: without the root_path a proxy mounted the app under (Ray Serve's route_prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def key_given(authorization: bytes, key: bytes, basic: bool = False) -> bool:
    """Whether the Authorization header carries the key: Bearer KEY, or (where `basic`) Basic with KEY as the
    password."""
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    if scheme.lower() == b"basic" and basic:
        try:
            token = base64.b64decode(token, validate=True).partition(b":")[2]
        except ValueError:
            return False
    elif scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token, key)


def needs_key(path: str, config: ServerConfig) -> bool:
    """Whether `path` needs the API key under this config (a prefix matches whole path segments)."""
    for prefix, opener in OPEN_PATHS:
        if _matches(path, prefix):
            return not getattr(config, opener)
    return True


def _json_type(content_type: bytes | None) -> bool:
    """application/json or a +json type (parameters such as charset aside), or no Content-Type at all."""
    if content_type is None:
        return True
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


async def _refuse(status: int, message: str, code: str | None, scope, receive, send,
                  type_: str = "invalid_request_error") -> None:
    """An OpenAI-style error sent before the route runs; the connection closes after it (its body may be unread)."""
    response = JSONResponse(error_body(message, type_, None, code), status_code=status,
                            headers={"Connection": "close"})
    await response(scope, receive, send)


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
        path = _route_path(scope)
        headers = dict(scope.get("headers") or ())
        if self._key is not None and needs_key(path, self.config):
            browser = any(_matches(path, p) for p in BROWSER_PATHS)
            basic = browser and scope.get("method") in ("GET", "HEAD")
            if not key_given(headers.get(b"authorization", b""), self._key, basic):
                challenge = 'Basic realm="twospeed", charset="UTF-8"' if browser else "Bearer"
                response = JSONResponse(error_body("missing or incorrect API key (send Authorization: Bearer KEY)",
                                                   "authentication_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": challenge})
                return await response(scope, receive, send)
        state = self.get_state()
        if state is not None and state.draining and scope.get("method") == "POST":
            return await _refuse(503, "the server is shutting down", None, scope, receive, send,
                                 "service_unavailable")
        if scope.get("method") in ("POST", "PUT", "PATCH") and not _json_type(headers.get(b"content-type")):
            return await _refuse(415, "request bodies must be JSON (Content-Type: application/json)",
                                 "unsupported_media_type", scope, None, send)
        limit = self.config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" in headers:
            return await _refuse(400, "a request may not carry both Content-Length and Transfer-Encoding",
                                 "bad_request", scope, None, send)
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
        await _refuse(413, f"the request body {got}; at most {limit:,} bytes are accepted (--max-body-bytes)",
                      "request_too_large", scope, receive, send)
