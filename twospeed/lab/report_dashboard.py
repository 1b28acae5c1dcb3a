"""dashboard.html beside report.html: the server's /dashboard views for a finished run, static and offline.

The live page's own code (twospeed/server/static: uPlot, charts.js, dashboard.js) is inlined into one file
with the run turned into the shape /dashboard/data serves (server/history.py): one record per request with
its split clock and bill, every inter-token gap, the lanes' totals and SLO outcomes, the tokens per step the
lab sampled from /metrics, and the KV memory cached prefixes held at the end. A miss's cause is named by the
server's own rule (schema/slo.py `attribute`), from the request's clock as the lab measured it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import datetime
from importlib import resources
from itertools import accumulate
from pathlib import Path

from twospeed.engine.request import Bill, Clock
from twospeed.lab.lane_facts import slo_misses
from twospeed.lab.workload import Price
from twospeed.schema.slo import Objective, attribute, workload_objectives

BILL_KEYS = ("prompt_tokens", "cached_tokens", "prefilled_tokens", "output_tokens", "forced_tokens", "goodput_tokens")


def _cause(r: dict, objectives: list[Objective]) -> str | None:
    """The server's attribution of a miss, from the lab's measured clock of the request."""
    if r["slo_met"] or r["ttft_s"] is None:
        return None if r["slo_met"] else "queue"
    queue, prefill = r["server_queue_s"] or 0.0, r["server_prefill_s"] or 0.0
    times = [r["ttft_s"], *(r["ttft_s"] + t for t in accumulate(r["itl_s"]))]
    clock = Clock(0.0, first_scheduled=queue, prefill_done=queue + prefill, first_token=r["ttft_s"],
                  token_times=times, finished=r["ttlt_s"], interfered_steps=r["server_interfered_steps"] or 0)
    names = set(slo_misses(r))
    worst = [o for o in objectives if o.name in names] or objectives
    return attribute(max(worst, key=lambda o: (o.value(clock) or 0.0) / o.threshold), clock, Bill(), 0)


def dashboard_data(doc: dict) -> dict:
    """The run as /dashboard/data would have served it at its end (times in Unix seconds)."""
    start = datetime.fromisoformat(doc["run"]["started_at"]).timestamp()
    objectives = {name: list(workload_objectives(lane.get("slo") or {})) for name, lane in doc["lanes"].items()}
    requests, gaps, totals, slo = [], {"t": [], "lane": [], "gap": []}, {}, {}
    for r in doc["requests"]:
        end = start + r["sent_s"] + (r["call_s"] or r["ttlt_s"] or 0.0)
        bill = {k: r.get(k) or 0 for k in BILL_KEYS}
        judged = bool(objectives.get(r["lane"])) and r["error"] is None
        met = r["slo_met"] if judged else None
        cause = None if met in (True, None) else _cause(r, objectives[r["lane"]])
        requests.append({"id": f"{r['lane']}-{r['index']}" + (f".{r['turn']}" if r["turn"] is not None else ""),
                         "lane": r["lane"], "t": end, "arrival": start + r["sent_s"],
                         "finish_reason": r["finish_reason"] or ("error" if r["error"] else None),
                         "aborted": r["error"] is not None, "queue": r["server_queue_s"],
                         "prefill": r["server_prefill_s"], "ttft": r["ttft_s"], "itl_p50": r["itl_p50_s"],
                         "itl_p99": r["itl_p99_s"], "itl_max": r["itl_max_s"],
                         "tpot": r["tpot_s"], "ttlt": r["ttlt_s"], "decode_steps": r["server_decode_steps"],
                         "interfered_steps": r["server_interfered_steps"], "preemptions": None, "bill": bill,
                         "met": met, "cause": cause, "missed": [m for m in r["slo_missed"].split(",") if m]})
        for g in r["itl_s"] if r["error"] is None else ():
            gaps["t"].append(end)
            gaps["lane"].append(r["lane"])
            gaps["gap"].append(g)
        totals.setdefault(r["lane"], Counter()).update(
            {**bill, "sequences": 1, "aborted": int(r["error"] is not None), "prefix_queries": bill["prompt_tokens"],
             "prefix_hits": bill["cached_tokens"]})
        if judged:
            slo.setdefault(r["lane"], Counter())[cause or "met"] += 1
    timeline = doc["server"]["timeline"] or []
    steps = {"t": [start + p["t_s"] for p in timeline],
             "num_prefill_tokens": [p["prefill_tokens_per_step"] for p in timeline],
             "num_decode_tokens": [p["decode_tokens_per_step"] for p in timeline]}
    kv = doc["server"]["kv_memory"]
    price = Price.parse((doc.get("workload") or {}).get("price"))
    bytes_per_block = (kv["kv_bytes_per_token"] or 0) * kv["block_size"] or None
    return {"now": start + doc["run"]["wall_s"], "window_s": doc["run"]["wall_s"], "lanes": list(doc["lanes"]),
            "steps": steps, "gaps": gaps, "requests": requests,
            "totals": {k: dict(v) for k, v in totals.items()}, "slo": {k: dict(v) for k, v in slo.items()},
            "load": {"running": {}, "waiting": {}, "kv_usage": None, "cached_blocks": kv["cached_blocks"]},
            "config": {"model": doc["run"]["model"], "num_blocks": None, "block_size": kv["block_size"],
                       "kv_bytes_per_block": bytes_per_block, "step_target_s": None,
                       "price_per_m": {"input": price.input_per_m, "cached_input": price.cached_input_per_m,
                                       "output": price.output_per_m},
                       "lanes": {name: {"priority": None, "objectives": [
                           {"name": o.name, "metric": o.metric, "threshold_s": o.threshold, "percentile": o.percentile}
                           for o in obs]} for name, obs in objectives.items()}}}


def _static(name: str) -> str:
    return resources.files("twospeed.server").joinpath("static", name).read_text(encoding="utf-8")


def write_dashboard(doc: dict, out: Path) -> Path:
    """dashboard.html in `out`: the live page's code and this run's data in one offline file."""
    page = _static("dashboard.html")
    data = json.dumps(dashboard_data(doc), allow_nan=False, separators=(",", ":")).replace("</", "<\\/")

    def inline(m: re.Match) -> str:
        tag, name = m.group(1), m.group(2)
        code = _static(name).replace("</", "<\\/") if tag == "script" else _static(name)
        if tag == "link":
            return f"<style>{code}</style>"
        before = f"<script>window.TWOSPEED_STATIC = {data};</script>\n" if name == "dashboard.js" else ""
        return f"{before}<script>{code}</script>"

    page = re.sub(r'<(script|link)[^>]*(?:src|href)="dashboard/static/([^"]+)"[^>]*>(?:</script>)?', inline, page)
    page = re.sub(r'\s*<a class="live-only"[^>]*>[^<]*</a>', "", page)  # the live server's pages: not here
    page = page.replace("<title>twospeed dashboard</title>", f"<title>twospeed run: {doc['run']['workload']}</title>")
    license = _static("vendor/uPlot.LICENSE").replace("--", "- -")
    page = page.replace("</body>", f"<!-- uPlot (inlined above):\n{license}-->\n</body>")
    path = out / "dashboard.html"
    path.write_text(page, encoding="utf-8")
    return path
