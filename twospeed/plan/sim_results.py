"""A simulated run in the lab's results.json: the same records, summaries, bill and diagnosis as `twospeed bench`.

Each simulated request becomes the lab's `Response` as a client of `twospeed serve` would have seen it: sent at
its arrival, every token at its engine emission time (one token a chunk, as the server streams a step's token),
the server's clock and bill in its `twospeed` object; then lab/bench.py's `assemble` judges, summarises and
bills them exactly as it does a live run, so `twospeed compare LIVE SIMULATED` sets the two side by side lane
by lane. Answers are not judged (the simulator has no text): every gate passes with the reason "simulated", so
goodput is the SLO's verdict alone. The client's own overhead (HTTP, tokenizing; a few ms) is not simulated.
`run.simulated` says how the run was made (cost model, topology, pool).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from twospeed.lab import diagnose, gates, job_results, results
from twospeed.lab.bench import assemble
from twospeed.lab.client import Response, Timing
from twospeed.lab.job_runner import JobRun
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import Planner
from twospeed.lab.scrape import CACHED_BLOCKS
from twospeed.lab.workload import Workload
from twospeed.plan.sim import SimRequest, SimRun, SimStep
from twospeed.plan.sim_workload import SimJob, SimTraffic
from twospeed.schema.clock import clock_json

SIMULATED = gates.GateResult(True, "simulated: answers are not judged")


@dataclass(slots=True)
class SimulateConfig:
    """A simulated run's settings, named as BenchConfig names them (results.json's `run` records them)."""

    workload: str  # built-in name, YAML file or JSONL trace
    model: str  # the model's name in the report
    requests: int | None = None  # requests (or jobs) in the plan; default 40 when no duration
    duration: float | None = None  # or arrivals for this many seconds
    rate: float | None = None  # total requests/s, split over lanes by share
    seed: int = 0
    salt: str = ""  # the plan's salt (a live run's, to send byte for byte the same prompts)
    scale: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    summarize_dumps: int | None = None
    unstable_prefix: bool = False
    label: str | None = None
    kv_block_size: int = 16
    url: str = "simulated"
    concurrency: int | None = None  # open loop only
    ignore_eos: bool = True  # the simulator is EOS-free
    late_threshold: float = 0.05


def response(req: SimRequest) -> Response:
    """What a streaming client of the server would have recorded for this request."""
    p = req.tag
    if req.error is not None:
        return Response(p, p.offset, req.arrival, status=400, error=req.error, finished=req.arrival, gate=SIMULATED)
    c, arrival = req.clock, req.arrival
    times = [t - arrival for t in c.token_times]
    itl = c.itl
    timing = Timing(c.ttft, c.ttlt, c.tpot, itl, list(itl), times, len(times), "twospeed")
    server = {"clock": clock_json(c), "bill": req.bill.as_dict(), "num_preemptions": req.num_preemptions, "slo": None}
    usage = {"prompt_tokens": req.bill.prompt_tokens, "completion_tokens": req.bill.output_tokens,
             "prompt_tokens_details": {"cached_tokens": req.bill.cached_tokens}}
    return Response(p, p.offset, arrival, timing, "", 200, None, req.finish_reason, usage, server, c.finished,
                    SIMULATED)


def job_run(job: SimJob, responses: dict[str, Response]) -> JobRun:
    return JobRun(job.planned, job.sent, job.finished, [responses[c.request_id] for c in job.calls], job.tool_s,
                  job.gate_s, job.steps_passed, SIMULATED if job.error is None else gates.GateResult(False, "not run"),
                  job.error)


def timeline(steps: list[SimStep], period: float = 0.5) -> list[dict]:
    """Tokens per engine step by kind in windows of `period` seconds, as the lab samples /metrics
    (lab/scrape.step_point: a kind's mean over the steps that carried it)."""
    out: list[dict] = []
    if not steps:
        return out
    end = max(s.start + s.seconds for s in steps)
    k = 0
    ordered = sorted(steps, key=lambda s: s.start + s.seconds)
    for i in range(1, int(end // period) + 2):
        t, window = i * period, []
        while k < len(ordered) and ordered[k].start + ordered[k].seconds <= t:
            window.append(ordered[k])
            k += 1
        point = {"t_s": t, "steps": float(len(window))}
        for kind in ("prefill", "decode"):
            counts = [getattr(s, f"{kind}_tokens") for s in window if getattr(s, f"{kind}_tokens")]
            point[f"{kind}_tokens_per_step"] = sum(counts) / len(counts) if counts else None
        out.append(point)
    return out


def results_doc(cfg: SimulateConfig, workload: Workload, counter: TokenCounter, planner: Planner, traffic: SimTraffic,
                run: SimRun, model_config: dict, simulated: dict) -> dict:
    """The results.json document of a simulated run, diagnosis included."""
    responses = {r.request_id: response(r) for r in traffic.requests}
    ends = [r.finished for r in responses.values() if r.finished is not None]
    ends += [j.finished for j in traffic.jobs]
    raw = {"responses": list(responses.values()), "jobs": [job_run(j, responses) for j in traffic.jobs],
           "wall": max(ends, default=0.0), "before": None, "after": {CACHED_BLOCKS: float(sum(run.cached_blocks))},
           "timeline": timeline(run.steps)}
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    doc = assemble(cfg, workload, counter, raw, started, model_config, planner)
    doc["run"]["simulated"] = {**simulated, "steps": len(run.steps), "peak_kv_blocks": run.peak_kv_blocks,
                               "replicas": run.config.num_replicas}
    doc["diagnosis"] = [d.as_dict() for d in diagnose.diagnose(doc)]
    return doc


def write(doc: dict, out: Path, report: bool = True) -> None:
    """results.json, requests.csv, jobs.csv (and report.html) in `out`, as `twospeed bench` writes them."""
    out.mkdir(parents=True, exist_ok=True)
    results.write_json(doc, out / "results.json")
    results.write_csv(doc["requests"], out / "requests.csv")
    results.write_csv(doc["jobs"], out / "jobs.csv", job_results.JOB_CSV_FIELDS)
    if report:
        from twospeed.lab.report import write_html

        write_html(doc, out)
