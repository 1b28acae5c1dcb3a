"""What a run says about one lane, read off its results.json: the facts the diagnosis rules (diagnose.py) test.

User-visible time is split by part: for a request, queue (server clock), prefill (TTFT less queue) and decode
(the stream after the first token); a job adds its tool and gate time. Each unit that missed its objective is
blamed on the parts that objective measures: a TTFT miss on queue and prefill, an ITL miss on decode, a
completion window (a request's, or a job's) on every part. The misses' summed blame says which speed hurt;
over every unit, which speed the user waits on. Beside that: prompt and cache numbers, the prefix check,
output length against what the gate needed, interference on the ITL misses, and output that repeats the
prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twospeed.lab import errors as error_classes
from twospeed.lab.job_results import call_split

CALL_PARTS = ("queue", "prefill", "decode")
JOB_PARTS = ("queue", "prefill", "decode", "tool", "gate")
# a missed objective's name (schema/slo.py's Objective.name) -> the parts of the clock it blames
BLAME = {"ttft_p99": ("queue", "prefill"), "itl_p99": ("decode",), "ttlt": CALL_PARTS}
# what results written before the lab named misses as the server does called them
OLDER_MISS_NAMES = {"ttft": "ttft_p99", "itl": "itl_p99", "completion_window": "ttlt"}
STALL_FRACTION = 0.5  # an ITL miss whose median gap is under this share of the objective is a stall


@dataclass(slots=True)
class Facts:
    lane: str
    unit: str  # "requests" | "jobs"
    n: int
    objective: str  # readable, "" when the lane has none
    missed: int  # units that missed their objective (a failed unit missed it: "error")
    misses_by: dict[str, int]  # objective -> units that missed it ("error": units that failed)
    problem: str  # "missed" (blame of the misses) | "all" (no objective: all user-visible time) | "none"
    time: dict[str, float]  # seconds per part over the problem set
    visible: dict[str, float]  # seconds per part over every unit
    server_clock: bool  # queue measured or derived from the server's clock; else TTFT counts as prefill
    calls: int = 0
    errors: int = 0  # calls that failed
    errors_by_class: dict[str, int] = field(default_factory=dict)  # errors.py class -> failed calls
    first_errors: dict[str, str] = field(default_factory=dict)  # class -> the first such error, as recorded
    failed_units: int = 0  # requests that failed, or jobs that ended on an error
    clock: str = ""  # whose clock split the time: "twospeed", "llama.cpp timings", "vLLM /metrics (lane)", ""
    run_clock_lanes: int = 0  # the run has a /metrics clock, but over this many lanes (not this lane's alone)
    prompt_tokens: float = 0.0  # means per call
    prefilled_tokens: float = 0.0
    problem_tokens: tuple[float, float] = (0.0, 0.0)  # mean prompt and prefilled tokens of the problem set's calls
    cached_share: float | None = None  # measured: cached / prompt tokens
    cache_reported: bool = False  # the server says how many tokens it served from cache
    prefill_s_per_token: float | None = None  # measured prefill seconds per prefilled token
    prefix_tokens: int = 0  # the lane's declared shared prefix
    prefix: dict | None = None  # prefix_score.lane_check of the lane's prompts
    observations: list[int] = field(default_factory=list)  # every tool result as it entered a job's history
    summarize: dict | None = None  # the dump policy in force
    output_tokens: float = 0.0
    answers: int = 0  # answers with at least one token
    length_share: float | None = None  # answers that ran to max_tokens
    max_tokens: float | None = None
    needed_share: float | None = None  # needed / output tokens over answers a JSON gate judged
    needed_tokens: float | None = None
    ignore_eos: bool = False
    itl_p50: float | None = None
    itl_p99: float | None = None
    itl_objective_s: float | None = None
    itl_misses: int = 0
    itl_stalls: int = 0  # of those, stalls: the stream's typical gap is fine, a few gaps are long
    itl_interfered: int = 0  # of those, with at least as many interfered steps as slow gaps (the server's count)
    itl_unknown: int = 0  # of those, with no server clock to count interfered steps
    itl_blamed: int = 0  # of those, stalls or interfered: something else ran in their slow steps
    itl_missed_p50: float | None = None  # the ITL misses' typical gap (jump-forward's zero gaps left out)
    itl_missed_max: float | None = None
    interfered_share: float | None = None  # interfered / decode steps over the lane
    repeat_share: float | None = None
    queue_p90: float | None = None  # per request; from a /metrics histogram, the bound of its p90 bucket
    gate_rate: float | None = None

    def share(self, part: str, of: str = "time") -> float:
        """The part's share of the problem time (or of `visible`)."""
        d = self.time if of == "time" else self.visible
        total = sum(d.values())
        return d.get(part, 0.0) / total if total > 0 else 0.0


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def objective_text(slo: dict, window_s: float | None) -> str:
    parts = []
    if slo.get("ttft_p99_ms") is not None:
        parts.append(f"TTFT ≤ {slo['ttft_p99_ms']:,.0f} ms")
    if slo.get("itl_p99_ms") is not None:
        parts.append(f"ITL p99 ≤ {slo['itl_p99_ms']:,.0f} ms")
    if slo.get("completion_window_s") is not None:
        parts.append(f"done within {slo['completion_window_s']:,.0f} s")
    if window_s is not None:
        parts.insert(0, f"job done within {window_s:,.0f} s")
    return ", ".join(parts)


def slo_misses(r: dict) -> list[str]:
    """The objectives a request's record missed, by the server's names (an older result's mapped), errors aside."""
    return [OLDER_MISS_NAMES.get(m, m) for m in (r.get("slo_missed") or "").split(",") if m and m != "error"]


def _blame(r: dict, queue_share: float | None = None) -> dict[str, float]:
    split, out = call_split(r, queue_share), {}
    for m in slo_misses(r):
        for part in BLAME.get(m, ()):
            out[part] = split[part]
    return out


def _add(into: dict[str, float], d: dict[str, float]) -> None:
    for k, v in d.items():
        into[k] = into.get(k, 0.0) + v


def _itl_misses(f: Facts, calls: list[dict]) -> None:
    """Classify the ITL misses: a stall (the stream's median gap under STALL_FRACTION of the objective, its tail
    over: something else ran in those steps) or slow steps throughout; and whether the server counted
    interfered steps (shared with a prefill chunk) for the slow gaps."""
    threshold = f.itl_objective_s
    typical, longest = [], []
    for r in calls:
        if "itl_p99" not in slo_misses(r):
            continue
        f.itl_misses += 1
        gaps = [g for g in r["itl_s"] if g > 0] or [0.0]
        median = float(np.median(gaps))
        typical.append(median)
        longest.append(max(gaps))
        stall = threshold is not None and median <= STALL_FRACTION * threshold
        f.itl_stalls += stall
        steps = r.get("server_interfered_steps")
        slow = sum(g > threshold for g in gaps) if threshold else 1
        interfered = steps is not None and steps > 0 and steps >= slow
        f.itl_unknown += steps is None
        f.itl_interfered += interfered
        f.itl_blamed += stall or interfered
    f.itl_missed_p50 = float(np.median(typical)) if typical else None
    f.itl_missed_max = max(longest) if longest else None


def _calls_facts(f: Facts, calls: list[dict], run: dict, queue_share: float | None = None) -> None:
    ok = [r for r in calls if r["error"] is None]
    f.calls, f.errors = len(calls), len(calls) - len(ok)
    f.errors_by_class = error_classes.count(calls)
    for r in calls:
        if r["error"] is not None:
            c = r.get("error_class") or error_classes.classify(r["error"], r.get("status") or 0)
            f.first_errors.setdefault(c, r["error"])
    prompt, cached = sum(r["prompt_tokens"] for r in ok), sum(r["cached_tokens"] for r in ok)
    f.prompt_tokens = prompt / len(ok) if ok else 0.0
    f.prefilled_tokens = (prompt - cached) / len(ok) if ok else 0.0
    f.cached_share = cached / prompt if prompt else None
    f.cache_reported = run.get("server_kind") == "twospeed" or cached > 0
    timed = [r for r in ok if r["ttft_s"] is not None and r["prefilled_tokens"] >= 64]
    pre_s = sum(r["server_prefill_s"] if r["server_prefill_s"] is not None else call_split(r, queue_share)["prefill"]
                for r in timed)
    pre_tok = sum(r["prefilled_tokens"] for r in timed)
    f.prefill_s_per_token = pre_s / pre_tok if pre_tok else None
    answered = [r for r in ok if r["output_tokens"] > 0]
    f.answers = len(answered)
    f.output_tokens = _mean(r["output_tokens"] for r in answered) or 0.0
    f.length_share = (sum(r["finish_reason"] == "length" for r in answered) / len(answered)) if answered else None
    f.max_tokens = _mean(r["max_tokens"] for r in answered)
    judged = [r for r in answered if r.get("needed_tokens") is not None]
    f.needed_tokens = _mean(r["needed_tokens"] for r in judged)
    out = sum(r["output_tokens"] for r in judged)
    f.needed_share = sum(r["needed_tokens"] for r in judged) / out if out else None
    gaps = [g for r in ok for g in r["itl_s"]]
    f.itl_p50 = float(np.percentile(gaps, 50)) if gaps else None
    f.itl_p99 = float(np.percentile(gaps, 99)) if gaps else None
    _itl_misses(f, ok)
    steps = [r for r in ok if r.get("server_decode_steps")]
    f.interfered_share = (sum(r["server_interfered_steps"] or 0 for r in steps) /
                          sum(r["server_decode_steps"] for r in steps)) if steps else None
    f.repeat_share = _mean(r.get("repeat_share") for r in answered)
    queues = [r["server_queue_s"] for r in ok if r["server_queue_s"] is not None]
    f.queue_p90 = float(np.percentile(queues, 90)) if queues else None
    per_request = bool(ok) and all(_clock_of(r) for r in ok)
    f.server_clock = per_request or (bool(ok) and queue_share is not None)
    f.clock = _clock_of(ok[0]) if per_request else ("vLLM /metrics (lane)" if f.server_clock else "")
    f.observations = [t for r in ok if r.get("call_kind") == "step" for t in r.get("observations") or []]


def _clock_of(r: dict) -> str:
    """Whose per-request clock a record carries ("" when none)."""
    if r.get("clock_source"):
        return r["clock_source"]
    return "twospeed" if r.get("server_ttft_s") is not None else ""


def queue_share(server_clock: dict | None) -> float | None:
    """The share of queue in queue + prefill over a lane's requests, from the server's /metrics histograms (the
    part of each request's TTFT the lab books as queue when the server times no request on its own)."""
    phases = (server_clock or {}).get("phases") or {}
    q, p = (phases.get("queue") or {}).get("sum_s"), (phases.get("prefill") or {}).get("sum_s")
    return q / (q + p) if q is not None and p is not None and q + p > 0 else None


def lane_facts(doc: dict, lane: str) -> Facts:
    """The facts of `lane` in the results.json document `doc`."""
    summary = doc["lanes"][lane]
    calls = [r for r in doc["requests"] if r["lane"] == lane]
    jobs = [j for j in doc.get("jobs") or [] if j["lane"] == lane]
    slo = summary.get("slo") or {}
    window = (summary.get("jobs") or {}).get("window", {}).get("window_s") if jobs else None
    f = Facts(lane, "jobs" if jobs else "requests", len(jobs) if jobs else len(calls),
              objective_text(slo, window), 0, {}, "none", {}, {}, False)
    f.itl_objective_s = slo["itl_p99_ms"] / 1e3 if slo.get("itl_p99_ms") is not None else None
    f.ignore_eos = bool(doc["run"].get("ignore_eos"))
    f.prefix, f.prefix_tokens = summary.get("prefix"), summary.get("prefix_tokens") or 0
    f.summarize = (summary.get("policy") or {}).get("summarize")
    f.gate_rate = summary["gate"]["rate"]
    share = queue_share(summary.get("server_clock"))
    _calls_facts(f, calls, doc["run"], share)
    if share is not None:
        queue = ((summary["server_clock"].get("phases") or {}).get("queue") or {})
        f.queue_p90 = queue.get("p90_s") if f.queue_p90 is None else f.queue_p90
    elif (doc.get("server") or {}).get("clock"):
        f.run_clock_lanes = len(doc["lanes"])
    missed_time: dict[str, float] = {}
    problem_calls: list[dict] = []
    timed = 0  # units that missed an objective with a time (not by failing)
    if jobs:
        by_job: dict[int, list[dict]] = {}
        for r in calls:
            by_job.setdefault(r["job"], []).append(r)
        for j in jobs:
            parts = {p: j[f"{p}_s"] for p in JOB_PARTS}
            failed = j.get("error") is not None
            if failed:
                f.failed_units += 1
                f.misses_by["error"] = f.misses_by.get("error", 0) + 1
            else:
                _add(f.visible, parts)
            late = not j["window_met"]
            slow_calls = [r for r in by_job.get(j["index"], []) if slo_misses(r)]
            if failed or late or slow_calls:
                f.missed += 1
            if late or slow_calls:
                timed += 1
                if late:
                    f.misses_by["window"] = f.misses_by.get("window", 0) + 1
                for r in slow_calls:
                    for m in slo_misses(r):
                        f.misses_by[m] = f.misses_by.get(m, 0) + 1
                if late:
                    _add(missed_time, parts)
                    problem_calls += by_job.get(j["index"], [])
                else:
                    for r in slow_calls:
                        _add(missed_time, _blame(r, share))
                    problem_calls += slow_calls
    else:
        for r in calls:
            if r["error"] is not None:
                f.failed_units += 1
                f.missed += 1
                f.misses_by["error"] = f.misses_by.get("error", 0) + 1
                continue
            _add(f.visible, call_split(r, share))
            misses = slo_misses(r)
            if misses:
                f.missed += 1
                timed += 1
                for m in misses:
                    f.misses_by[m] = f.misses_by.get(m, 0) + 1
                _add(missed_time, _blame(r, share))
                problem_calls.append(r)
    if timed:
        f.problem, f.time = "missed", missed_time
    elif not f.objective:
        f.problem, f.time, problem_calls = "all", dict(f.visible), [r for r in calls if r["error"] is None]
    elif f.missed:
        f.problem, f.time = "missed", {}  # only failures: no time to blame
    ok = [r for r in problem_calls if r["error"] is None]
    if ok:
        f.problem_tokens = (_mean(r["prompt_tokens"] for r in ok), _mean(r["prefilled_tokens"] for r in ok))
    return f
