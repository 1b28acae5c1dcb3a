"""GuardMiddleware: the API key, and no new work while draining, before any route or body parsing runs.

Pure ASGI, so streaming responses and disconnects pass through untouched. Which paths need the key is one
table, `KEYED_PATHS`: a path prefix and the ServerConfig flag that opens it without the key (None: never).
A new router that reveals the API or data adds its prefix there.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from twospeed.server.config import ServerConfig
from twospeed.server.errors import error_body

KEYED_PATHS: list[tuple[str, str | None]] = [
    ("/v1", None),
    ("/metrics", "metrics_public"),
    ("/health", "metrics_public"),
]


def needs_key(path: str, config: ServerConfig) -> bool:
    """Whether `path` needs the API key under this config (a prefix matches whole path segments)."""
    for prefix, opener in KEYED_PATHS:
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return not (opener and getattr(config, opener))
    return False


class GuardMiddleware:
    """API key (KEYED_PATHS), and 503 for new work while the server drains."""

    def __init__(self, app, get_state, config: ServerConfig):
        self.app = app
        self.get_state = get_state
        self.config = config
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self._key is not None and needs_key(path, self.config):
            scheme, _, token = dict(scope.get("headers") or ()).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                response = JSONResponse(error_body("missing or incorrect API key (send Authorization: Bearer KEY)",
                                                   "authentication_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        state = self.get_state()
        if state is not None and state.draining and path.startswith("/v1/") and scope.get("method") == "POST":
            response = JSONResponse(error_body("the server is shutting down", "service_unavailable"), status_code=503,
                                    headers={"Connection": "close"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)
