"""The job clock and bill: one judged record per job, and a job lane's summary.

A job's wall time (first send -> last gate done) splits into
  queue    the server's queue time of each call (0 where the server gives no clock)
  prefill  each call's client TTFT less its server queue (with no server clock, all of TTFT)
  decode   each call's stream after its first token (client end of stream - TTFT)
  tool     tool round trips between calls
  gate     judging answers (each gate's check and its latency)
  other    the rest: the harness's own time building prompts, and failed calls
so the parts sum to the wall time by construction, and `other` says how much the lab could not attribute
(it stays a few ms per job). Tokens per turn (prompt, cached, prefilled, output, tool observations) come
from each call's record. A job is good when every call succeeded, every step passed its gate, the job gate
passed, and it finished inside the lane's window.
"""

from __future__ import annotations

import numpy as np

from twospeed.lab import bill as billing
from twospeed.lab import stats
from twospeed.lab.job_runner import JobRun

PARTS = ("queue", "prefill", "decode", "tool", "gate", "other")
JOB_CSV_FIELDS = ("index", "lane", "error", "intended_s", "sent_s", "lag_s", "wall_s", *(f"{p}_s" for p in PARTS),
                  "clock_source", "calls", "prompt_tokens", "cached_tokens", "prefilled_tokens", "output_tokens",
                  "observation_tokens", "prompt_tokens_per_turn", "cached_tokens_per_turn", "steps_passed",
                  "job_gate_passed", "job_gate_reason", "window_s", "window_met", "good", "goodput_tokens", "cost_usd")


def call_split(r: dict, queue_share: float | None = None) -> dict:
    """One call's queue / prefill / decode (s) from its record; zeros for a call that got no first token. Queue is
    the server's own (twospeed); else the client's TTFT less the server's prefill (llama.cpp times prefill, not the
    wait for a slot); else `queue_share` of TTFT (the share of queue in the server's TTFT over the lane, from vLLM's
    /metrics); else 0 (TTFT counts as prefill)."""
    if r["error"] is not None or r["ttft_s"] is None:
        return {"queue": 0.0, "prefill": 0.0, "decode": 0.0}
    ttft = r["ttft_s"]
    if r.get("server_queue_s") is not None:
        queue = min(r["server_queue_s"], ttft)
    elif r.get("server_prefill_s") is not None:
        queue = max(0.0, ttft - r["server_prefill_s"])
    elif queue_share is not None:
        queue = ttft * queue_share
    else:
        queue = 0.0
    end = r["call_s"] if r.get("call_s") is not None else r["ttlt_s"]
    return {"queue": queue, "prefill": r["ttft_s"] - queue, "decode": max(0.0, end - r["ttft_s"])}


def job_record(run: JobRun, calls: list[dict], window_s: float | None, price, queue_share: float | None = None) -> dict:
    """Judge and split one job; `calls` are its calls' records (results.record), in turn order; `queue_share` as
    in call_split."""
    wall = run.finished - run.sent
    parts = {p: 0.0 for p in PARTS}
    for r in calls:
        for k, v in call_split(r, queue_share).items():
            parts[k] += v
    parts["tool"], parts["gate"] = run.tool_s, run.gate_s
    parts["other"] = wall - sum(parts.values())
    window_met = window_s is None or wall <= window_s
    good = run.error is None and run.steps_passed and run.job_gate.passed and window_met
    b = billing.total(calls) if calls else {k: 0 for k in billing.FIELDS}
    b["goodput_tokens"] = b["output_tokens"] if good else 0
    intended = run.planned.offset
    return {
        "index": run.planned.index, "lane": run.planned.lane, "error": run.error,
        "intended_s": intended, "sent_s": run.sent, "lag_s": None if intended is None else run.sent - intended,
        "wall_s": wall, **{f"{p}_s": v for p, v in parts.items()},
        "clock_source": clock_source(calls, queue_share),
        "calls": len(calls), **b, "observation_tokens": sum(r["observation_tokens"] or 0 for r in calls),
        "cost_usd": billing.money(b, price)["total_usd"],
        "turns": [{"turn": r["turn"], "step": r["step"], "prompt_tokens": r["prompt_tokens"],
                   "cached_tokens": r["cached_tokens"], "output_tokens": r["output_tokens"],
                   "observation_tokens": r["observation_tokens"], "ttft_s": r["ttft_s"],
                   "prefill_s": call_split(r, queue_share)["prefill"]} for r in calls],
        "prompt_tokens_per_turn": ";".join(str(r["prompt_tokens"]) for r in calls),
        "cached_tokens_per_turn": ";".join(str(r["cached_tokens"]) for r in calls),
        "steps_passed": run.steps_passed, "job_gate_passed": run.job_gate.passed,
        "job_gate_reason": run.job_gate.reason, "window_s": window_s, "window_met": window_met, "good": good,
    }


def clock_source(calls: list[dict], queue_share: float | None = None) -> str:
    """Whose clock split the job's calls: the server's per request (its name), the server's over the lane
    (queue_share), or the client's alone."""
    sources = {r.get("clock_source") or ("twospeed" if r.get("server_ttft_s") is not None else None) for r in calls}
    if calls and len(sources) == 1 and None not in sources:
        return sources.pop()
    return "server aggregate" if queue_share is not None else "client"


def _mean(values: list) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def per_turn(jobs: list[dict]) -> list[dict]:
    """Means over jobs, turn by turn: prompt growth and how much of it the prefix cache served."""
    by_turn: dict[int, list[dict]] = {}
    for j in jobs:
        for t in j["turns"]:
            by_turn.setdefault(t["turn"], []).append(t)
    out = []
    for turn in sorted(by_turn):
        ts = by_turn[turn]
        prompt, cached = sum(t["prompt_tokens"] for t in ts), sum(t["cached_tokens"] for t in ts)
        out.append({"turn": turn, "calls": len(ts), "prompt_tokens": prompt / len(ts), "cached_tokens": cached / len(ts),
                    "prefilled_tokens": (prompt - cached) / len(ts), "hit_rate": cached / prompt if prompt else None,
                    "observation_tokens": _mean([t["observation_tokens"] for t in ts]),
                    "ttft_s": _mean([t["ttft_s"] for t in ts]), "prefill_s": _mean([t["prefill_s"] for t in ts])})
    return out


def per_call(jobs: list[dict]) -> dict:
    """Mean tokens per call (a turn) over the lane's jobs, and the cache hit."""
    calls = sum(j["calls"] for j in jobs)
    prompt, cached = sum(j["prompt_tokens"] for j in jobs), sum(j["cached_tokens"] for j in jobs)
    return {"prompt_tokens": prompt / calls if calls else None, "cached_tokens": cached / calls if calls else None,
            "prefilled_tokens": (prompt - cached) / calls if calls else None, "hit_rate": cached / prompt if prompt else None}


def jobs_summary(jobs: list[dict], window_s: float | None, wall_s: float | None, seed: int) -> dict:
    """A job lane's jobs: the wall time and its split, calls, per-turn growth, window, gates and goodput."""
    n = len(jobs)
    ok = [j for j in jobs if j["error"] is None]
    total = {p: sum(j[f"{p}_s"] for j in jobs) for p in PARTS}
    wall = sum(j["wall_s"] for j in jobs)
    met = sum(j["window_met"] for j in jobs)
    good = [j for j in jobs if j["good"]]
    return {
        "jobs": n, "errors": n - len(ok),
        "stats": {"wall": stats.summarize([j["wall_s"] for j in ok], seed=seed),
                  **{p: stats.summarize([j[f"{p}_s"] for j in ok], seed=seed) for p in PARTS}},
        "split_s": {**total, "wall": wall},
        "share": {p: (v / wall if wall > 0 else None) for p, v in total.items()},
        "calls": {"total": sum(j["calls"] for j in jobs), "mean": _mean([j["calls"] for j in jobs])},
        "turns": per_turn(jobs),
        "per_call": per_call(jobs),
        "window": {"window_s": window_s, "met_jobs": met, "attainment": met / n if n else None,
                   "attainment_ci": stats.proportion_ci(met, n)},
        "gates": {"steps_passed": sum(j["steps_passed"] for j in jobs),
                  "job_gate_passed": sum(j["job_gate_passed"] for j in jobs)},
        "goodput": {"jobs": len(good), "rate": len(good) / n if n else None,
                    "rate_ci": stats.proportion_ci(len(good), n), "tokens": sum(j["goodput_tokens"] for j in jobs)},
        "throughput": {"jobs_per_s": n / wall_s if wall_s else None},
    }
