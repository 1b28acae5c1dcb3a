"""Operations routes: /health (200 once the model is loaded, 503 while shutting down) and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from twospeed.server.errors import ERROR_RESPONSES, APIError
from twospeed.server.metrics import CONTENT_TYPE
from twospeed.server.state import State

router = APIRouter()


@router.get("/health", responses=ERROR_RESPONSES)
async def health(request: Request):
    state = getattr(request.app.state, "twospeed", None)
    if state is None or state.draining or not state.async_engine.is_alive:
        raise APIError(503, "not ready" if state is None or not state.draining else "shutting down",
                       "service_unavailable")
    return {"status": "ok"}


@router.get("/metrics", responses=ERROR_RESPONSES)
async def metrics(state: State):
    return Response(await state.metrics.render_shared(state.run), media_type=CONTENT_TYPE)
