"""The ingress's own routes: /metrics and /dashboard/data of the whole cluster, and /cluster/replicas.

build_app includes this router before the server's, so these answer their paths instead of the single-engine
ones: /metrics merges every replica's metrics (labelled `replica`) with the router's (cluster/metrics.py);
/dashboard/data merges their histories (cluster/history.py) and adds `replicas`, which the page shows as its
replicas view. Guarded like the rest (server/guard.py).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Query
from fastapi.responses import Response

from twospeed.server.errors import ERROR_RESPONSES
from twospeed.server.metrics import CONTENT_TYPE
from twospeed.server.routes_dashboard import page_config
from twospeed.server.state import State

router = APIRouter()


@router.get("/metrics", responses=ERROR_RESPONSES)
async def metrics(state: State):
    return Response(await state.async_engine.merged_metrics(), media_type=CONTENT_TYPE)


@router.get("/dashboard/data", include_in_schema=False)
async def dashboard_data(state: State, since: float | None = Query(None)):
    doc = {**await state.async_engine.merged_history(since), "config": page_config(state)}
    return _json(doc)


@router.get("/cluster/replicas", responses=ERROR_RESPONSES)
async def replicas(state: State):
    """Each engine replica as the router sees it: up, instance, load, requests routed by reason, lost."""
    client = state.async_engine
    return _json({"router": client.config.router, "replicas": client.replicas()})


def _json(doc: dict) -> Response:
    return Response(json.dumps(doc, allow_nan=False, separators=(",", ":")), media_type="application/json",
                    headers={"Cache-Control": "no-store"})
