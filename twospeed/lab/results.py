"""A run's results: one judged record per request, per-lane statistics, the bill, and the files that hold them.

results.json follows results.schema.json (next to this file; `validate` checks a document against it) and
requests.csv has one row per request with every timing and bill field (a job's calls are rows too, with their
job and turn; jobs.csv has one row per job, job_results.py). Times are seconds.
"""

from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path

import jsonschema
import numpy as np

from twospeed.lab import answer_stats, errors, gates, stats
from twospeed.lab import bill as billing
from twospeed.lab.client import Response, Timing
from twospeed.lab.server_kind import ANY
from twospeed.lab.workload import Workload
from twospeed.schema.slo import LaneSLO
from twospeed.schema.twospeed_object import read_twospeed

SCHEMA_VERSION = 2  # 2: job lanes (jobs, job and turn per request), throughput, prefix checks, diagnosis
METRICS = ("ttft", "itl", "chunk_gap", "tpot", "ttlt", "queue", "prefill", "server_ttft")
CSV_FIELDS = ("index", "lane", "job", "turn", "step", "status", "error", "error_class", "intended_s", "sent_s", "lag_s", "prompt_tokens",
              "prompt_tokens_asked", "cached_tokens", "prefilled_tokens", "observation_tokens", "output_tokens", "max_tokens", "needed_tokens",
              "goodput_tokens", "forced_tokens", "cost_usd", "ttft_s", "ttlt_s", "call_s", "tpot_s",
              "itl_p50_s", "itl_p99_s", "itl_max_s", "num_chunks", "chunk_gap_p50_s", "chunk_gap_max_s",
              "token_source", "clock_source", "server_queue_s", "server_route_s", "server_prefill_s", "server_decode_s",
              "server_ttft_s", "server_ttlt_s", "server_decode_steps", "server_interfered_steps", "server_slo_met", "spec_proposed", "spec_accepted",
              "spec_verify_steps", "spec_acceptance_length", "steps", "steps_per_token", "finish_reason", "gate_passed",
              "gate_reason", "slo_met", "slo_missed", "good")


def schema() -> dict:
    return json.loads(resources.files("twospeed.lab").joinpath("results.schema.json").read_text())


def validate(doc: dict) -> None:
    """Raises jsonschema.ValidationError if `doc` is not a valid results.json."""
    jsonschema.validate(doc, schema())


def judge_slo(slo: LaneSLO, timing: Timing) -> list[str]:
    """The objectives this request missed (empty = met), named as the server names them, judged by the lane's
    one judge on what the client timed (its TTFT, its own token gaps, its TTLT)."""
    return [o.name for _, o in slo.misses(lambda o: o.measure(timing.itl, ttft=timing.ttft, ttlt=timing.ttlt))]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _client_prompt_tokens(planned, endpoint: str, counter) -> int:
    """The prompt's tokens as the client counts them (only used when the server says nothing)."""
    if "prompt_tokens" in planned.meta:
        return planned.meta["prompt_tokens"]
    return counter.billed(planned.prompt, endpoint, planned.messages)


def _prompt_text(planned) -> str:
    if planned.messages:
        return "\n".join(str(m.get("content") or "") for m in planned.messages)
    return planned.prompt


def record(resp: Response, workload: Workload, counter) -> dict:
    """Judge one response: gate, SLO, bill, money; plus its timing fields. A job's call comes judged by its
    step's gate (resp.gate); its record names the job and the turn."""
    p = resp.planned
    lane = workload.lane(p.lane)
    gate_config = lane.gate if p.turn is None else {"type": "none"}
    t = resp.timing
    ok = resp.error is None and t is not None and t.output_tokens > 0
    if resp.gate is not None:
        gate = resp.gate
    else:
        gate = gates.run_gate(gate_config, resp.text, p.meta) if ok else gates.GateResult(False, "no answer")
    itl_p99 = _pct(t.itl, 99) if ok else None
    missed = judge_slo(lane.slo, t) if ok else ["error"]
    good = ok and gate.passed and not missed
    c = resp.clock if resp.clock is not None else ANY.request_clock(resp)  # a Response built without a stream
    counted = 0 if resp.usage or resp.server or c else _client_prompt_tokens(p, lane.endpoint, counter)
    b = billing.request_bill(resp.usage, resp.server, counted, t.output_tokens if t else 0, good, c)
    clock = {} if c is None else {"queue_ms": c.queue_ms, "route_ms": c.route_ms, "prefill_ms": c.prefill_ms,
                                  "decode_ms": c.decode_ms, "ttft_ms": c.ttft_ms, "ttlt_ms": c.ttlt_ms,
                                  "decode_steps": c.decode_steps, "interfered_steps": c.interfered_steps}
    report = read_twospeed(resp.server)
    slo, spec = (report.slo, report.spec) if report else (None, None)
    steps = _steps(clock, t) if ok else None
    info = p.turn
    return {
        "index": p.index, "lane": lane.name, "job": info.job if info else None, "turn": info.turn if info else None,
        "step": info.step if info else None, "status": resp.status, "error": resp.error,
        "error_class": errors.classify(resp.error, resp.status),
        "intended_s": resp.intended, "sent_s": resp.sent,
        "lag_s": None if resp.intended is None else resp.sent - resp.intended,
        **b, "prompt_tokens_asked": p.meta.get("prompt_tokens_asked"),
        "observation_tokens": info.observation_tokens if info else None,
        "observations": list(info.observations) if info else [], "call_kind": info.kind if info else None,
        "max_tokens": p.max_tokens,
        "needed_tokens": answer_stats.needed_tokens(resp.text, b["output_tokens"], info_gate(resp, gate_config),
                                                    counter) if ok else None,
        "repeat_share": answer_stats.repeat_share(_prompt_text(p), resp.text) if ok else None,
        "cost_usd": billing.money(b, workload.price)["total_usd"],
        "ttft_s": t.ttft if t else None, "ttlt_s": t.ttlt if t else None,
        "call_s": None if resp.finished is None else resp.finished - resp.sent, "tpot_s": t.tpot if t else None,
        "itl_p50_s": _pct(t.itl, 50) if t else None, "itl_p99_s": itl_p99, "itl_max_s": max(t.itl) if t and t.itl else None,
        "num_chunks": len(t.chunk_gaps) + 1 if t and t.output_tokens else 0,
        "chunk_gap_p50_s": _pct(t.chunk_gaps, 50) if t else None,
        "chunk_gap_max_s": max(t.chunk_gaps) if t and t.chunk_gaps else None,
        "token_source": t.source if t else None, "clock_source": c.source if c else None,
        "server_queue_s": _s(clock.get("queue_ms")), "server_route_s": _s(clock.get("route_ms")),
        "server_prefill_s": _s(clock.get("prefill_ms")), "server_decode_s": _s(clock.get("decode_ms")),
        "server_ttft_s": _s(clock.get("ttft_ms")), "server_ttlt_s": _s(clock.get("ttlt_ms")),
        "server_decode_steps": clock.get("decode_steps"), "server_interfered_steps": clock.get("interfered_steps"),
        "server_slo_met": slo.met if slo else None, "spec_verify_steps": spec.verify_steps if spec else None,
        "spec_acceptance_length": spec.mean_acceptance_length if spec else None, "steps": steps,
        "steps_per_token": steps / b["output_tokens"] if steps and b["output_tokens"] else None,
        "finish_reason": resp.finish_reason,
        "gate_passed": gate.passed, "gate_reason": gate.reason, "slo_met": not missed, "slo_missed": ",".join(missed),
        "good": good, "itl_s": list(t.itl) if t else [], "chunk_gaps_s": list(t.chunk_gaps) if t else [],
        "text_head": resp.text[:200], "text": resp.text,
    }


def _steps(clock: dict, timing) -> int | None:
    """Engine steps that yielded the answer's tokens: the server's decode steps plus the prefill's sample when it
    says (twospeed), else the streamed chunks that carried tokens (a server streams one per step). Tokens a step
    yields beyond one (speculation, jump-forward) are what makes steps per token fall below 1."""
    if clock.get("decode_steps") is not None:
        return clock["decode_steps"] + 1
    return len(timing.chunk_gaps) + 1 if timing.output_tokens else None


def spec_summary(records: list[dict]) -> dict:
    """Speculation over some requests: drafts verified and kept (twospeed's bill), verify steps, the mean
    acceptance length (tokens a verify step yielded), and steps per output token (any server: see _steps)."""
    with_steps = [r for r in records if r.get("steps")]
    steps, tokens = sum(r["steps"] for r in with_steps), sum(r["output_tokens"] for r in with_steps)
    proposed = sum(r.get("spec_proposed") or 0 for r in records)
    accepted = sum(r.get("spec_accepted") or 0 for r in records)
    verify = sum(r.get("spec_verify_steps") or 0 for r in records)
    return {"proposed": proposed, "accepted": accepted, "verify_steps": verify,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_acceptance_length": 1 + accepted / verify if verify else None,
            "steps_per_token": steps / tokens if tokens else None}


def info_gate(resp: Response, lane_gate: dict) -> dict:
    """The gate config an answer was judged by (a job call's step gate travels in its meta)."""
    return resp.planned.meta.get("gate", lane_gate) if resp.planned.turn is not None else lane_gate


def lane_summary(records: list[dict], slo: LaneSLO | None, price, seed: int, wall_s: float | None = None) -> dict:
    """Statistics, gate pass rate, SLO attainment, goodput, bill and throughput over some requests."""
    ok = [r for r in records if r["error"] is None]
    values = {"ttft": [r["ttft_s"] for r in ok], "itl": [g for r in ok for g in r["itl_s"]],
              "chunk_gap": [g for r in ok for g in r["chunk_gaps_s"]], "tpot": [r["tpot_s"] for r in ok],
              "ttlt": [r["ttlt_s"] for r in ok], "queue": [r["server_queue_s"] for r in ok],
              "prefill": [r["server_prefill_s"] for r in ok], "server_ttft": [r["server_ttft_s"] for r in ok]}
    n = len(records)
    passed = sum(r["gate_passed"] for r in records)
    met = sum(r["slo_met"] for r in records)
    good = sum(r["good"] for r in records)
    b = billing.total(records)
    attainment = met / n if n else None
    return {
        "requests": n, "errors": n - len(ok), "errors_by_class": errors.count(records),
        "stats": {m: stats.summarize(v, seed=seed) for m, v in values.items()},
        "gate": {"passed": passed, "rate": passed / n if n else None, "rate_ci": stats.proportion_ci(passed, n),
                 "failures": _top_reasons([r["gate_reason"] for r in records if not r["gate_passed"]])},
        "slo": {**(slo.workload_dict() if slo else {}), "met_requests": met, "attainment": attainment,
                "attainment_ci": stats.proportion_ci(met, n),
                "met": None if slo is None or attainment is None else attainment >= slo.attainment_target},
        "goodput": {"requests": good, "rate": good / n if n else None, "tokens": b["goodput_tokens"]},
        "bill": {**b, **billing.money(b, price)},
        "throughput": throughput(len(ok), b["output_tokens"], wall_s),
        "spec": spec_summary(ok),
        "prompt_fit": prompt_fit(ok),
    }


def prompt_fit(records: list[dict]) -> dict:
    """Billed prompt tokens against what the lane asked for: prompts billed otherwise are ones whose lane asks
    for less than its template takes, or a server whose tokenizer is not --tokenizer."""
    asked = [r for r in records if r.get("prompt_tokens_asked") is not None]
    off = [r["prompt_tokens"] - r["prompt_tokens_asked"] for r in asked if r["prompt_tokens"] != r["prompt_tokens_asked"]]
    return {"asked": len(asked), "off": len(off), "max_over": max(off, default=0), "max_under": -min(off, default=0)}


def throughput(completed: int, output_tokens: int, wall_s: float | None) -> dict:
    """Completed requests and output tokens per second of the run's wall time (vLLM bench's request and output
    token throughput)."""
    ok = bool(wall_s) and wall_s > 0
    return {"requests_per_s": completed / wall_s if ok else None, "output_tokens_per_s": output_tokens / wall_s if ok else None}


def _top_reasons(reasons: list[str], k: int = 3) -> list[dict]:
    counts: dict[str, int] = {}
    for r in reasons:
        key = r.split(":")[0][:80]
        counts[key] = counts.get(key, 0) + 1
    return [{"reason": r, "count": c} for r, c in sorted(counts.items(), key=lambda x: -x[1])[:k]]


def write_csv(records: list[dict], path: Path, fields: tuple[str, ...] = CSV_FIELDS) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)


def write_json(doc: dict, path: Path) -> None:
    """Write, then validate (a schema failure is a bug in the lab; the run's data is kept for it)."""
    path.write_text(json.dumps(doc, indent=1, allow_nan=False))
    validate(doc)


def load(run: str | Path) -> dict:
    """A results.json, or a run folder holding one."""
    path = Path(run)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise ValueError(f"{run}: no results.json")
    doc = json.loads(path.read_text())
    try:
        validate(doc)
    except jsonschema.ValidationError as e:
        raise ValueError(f"{path}: not a twospeed results.json: {e.message}") from None
    return doc
