"""The dashboard: GET /dashboard (the live page), /dashboard/data (its JSON), /dashboard/clock (the two-clocks toy
in the browser), /dashboard/costs (this engine's calibrated step costs for it), /dashboard/static/* (the page's
scripts and the vendored chart library).

The pages are static files in server/static/ (no build step; uPlot vendored under static/vendor/ with its
license): they work offline and ask nothing of any host but this server. /dashboard/data serves the history
(server/history.py) appended after `since` plus the facts the page needs to turn counts into MiB and money
(the KV pool's block size and bytes, the price table, the lanes' SLOs). Guarded like /metrics: with
--api-key these need the key unless --metrics-public (guard.OPEN_PATHS).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response

from twospeed.server.errors import ERROR_RESPONSES, APIError
from twospeed.server.state import ServerState, State

router = APIRouter(include_in_schema=False)

# The files the page may load: name -> media type. Nothing else is served from static/.
STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "clock.js": "text/javascript",
          "charts.js": "text/javascript", "vendor/uPlot.iife.min.js": "text/javascript",
          "vendor/uPlot.min.css": "text/css", "vendor/uPlot.LICENSE": "text/plain"}
_NO_STORE = {"Cache-Control": "no-store"}


@lru_cache(maxsize=None)
def static_file(name: str) -> bytes:
    return resources.files("twospeed.server").joinpath("static", name).read_bytes()


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard():
    return HTMLResponse(static_file("dashboard.html"))


@router.get("/dashboard/clock", response_class=HTMLResponse)
async def clock():
    return HTMLResponse(static_file("clock.html"))


@router.get("/dashboard/static/{name:path}", responses=ERROR_RESPONSES)
async def static(name: str):
    if name not in STATIC:
        raise APIError(404, f"no such file: {name}", "not_found_error")
    return Response(static_file(name), media_type=STATIC[name], headers={"Cache-Control": "max-age=3600"})


@router.get("/dashboard/data", responses=ERROR_RESPONSES)
async def data(state: State, since: float | None = Query(None, description="Unix s; negative: the last -since s")):
    """The history appended after `since` (all it keeps when absent) and the page's facts."""
    return _json({**state.history.since(since), "config": page_config(state)})


@router.get("/dashboard/costs", responses=ERROR_RESPONSES)
async def costs(state: State):
    """This engine's step cost model as the toy clock's coefficients (fetched once by /dashboard/clock)."""
    return _json(calibrated_costs(state.engine))


def _json(doc: dict) -> Response:
    return Response(json.dumps(doc, allow_nan=False, separators=(",", ":")), media_type="application/json",
                    headers=_NO_STORE)


def page_config(state: ServerState) -> dict:
    """What the page needs beside the history: the pool (to turn blocks into MiB), prices, lanes, the target."""
    engine = state.engine
    target = getattr(engine.scheduler_config, "target_step_time", None)
    return {"model": state.model_name, "num_blocks": engine.num_blocks, "block_size": engine.config.cache.block_size,
            "kv_bytes_per_block": state.kv_bytes_per_block, "step_target_s": target,
            "price_per_m": state.price_per_m(),
            "lanes": {name: {"priority": slo.priority,
                             "objectives": [{"name": o.name, "metric": o.metric, "threshold_s": o.threshold,
                                             "percentile": o.percentile} for o in slo.objectives]}
                      for name, slo in state.slos.lanes.items()}}


def calibrated_costs(engine) -> dict:
    """The engine's step cost model (engine.cost_model: a linear model over the step's shape) mapped onto the toy
    clock's terms. For one prompt of n tokens alone in a step the model says
        step + prefill_tokens*n + prefill_attention*n(n+1)/2 + sampled,
    so a = prefill_attention/2, b = prefill_tokens + prefill_attention/2, and a fixed part per prefill
    (prefill_fixed = step + sampled) that the toy has not got; one decode step over c cached tokens is
        step + decode_tokens + decode_context*(c+1) + sampled,
    so step = step + decode_tokens + decode_context + sampled and per_cached_token = decode_context."""
    model = getattr(engine, "cost_model", None)
    coefficients = getattr(model, "coefficients", None)
    if not coefficients:
        return {"available": False, "reason": "this engine has no calibrated step cost model"}
    c = {k: float(v) for k, v in coefficients.items()}
    get = c.get
    toy = {"a": get("prefill_attention", 0.0) / 2, "b": get("prefill_tokens", 0.0) + get("prefill_attention", 0.0) / 2,
           "step": get("step", 0.0) + get("decode_tokens", 0.0) + get("decode_context", 0.0) + get("sampled", 0.0),
           "per_cached_token": get("decode_context", 0.0), "prefill_fixed": get("step", 0.0) + get("sampled", 0.0)}
    return {"available": True, "source": f"engine cost model {getattr(model, 'key', '')}".strip(),
            "observations": getattr(model, "num_observed", None), "coefficients": c, "toy": toy}
