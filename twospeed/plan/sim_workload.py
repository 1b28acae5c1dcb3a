"""From the lab's workload to the simulator's requests: the run plan `twospeed bench` sends, as token ids.

The plan comes from lab/schedule.py's Planner under the same PlanConfig (seed, salt, scale, caps, rate), so a
simulated run and `twospeed bench` with the same flags send the same requests at the same offsets with the same
prompts. Each prompt becomes the ids the server computes (`TokenCounter.prompt_ids`: a completion with the
special tokens, a chat through its template), so the prefix cache sees what the live engine sees. Without the
model's tokenizer (a config.json alone) words become hashed ids, so shared prefixes still share ids.

Job lanes: an arrival is a job whose script (lab/job_script.py) builds each call's prompt from the job's history.
The simulated answer to a call is filler text of its output length (its output ids are that text's ids, so the
next turn's prompt, which carries the answer, hits the blocks the answer filled), every gate passes (answers are
not judged here; a gate's latency is still spent), tools take their drawn latency, and the next call goes out
when those are done, as the lab's job runner sends it. A job's calls stay on one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from twospeed.lab import prompts
from twospeed.lab.job_runner import call_planned
from twospeed.lab.job_script import Call, ContextFull
from twospeed.lab.schedule import Planned, Planner
from twospeed.lab.workload import Workload
from twospeed.plan.sim import SimRequest, Simulator


@dataclass(slots=True)
class SimJob:
    """One agent job as the simulator ran it (times in s from the run start; lab/job_runner.JobRun's fields)."""

    planned: Planned
    sent: float = 0.0
    finished: float = 0.0
    calls: list[SimRequest] = field(default_factory=list)
    tool_s: float = 0.0
    gate_s: float = 0.0
    steps_passed: bool = False
    error: str | None = None


class SimTraffic:
    """Feeds a Simulator the plan's requests and drives its jobs; `requests` and `jobs` hold what ran."""

    def __init__(self, sim: Simulator, workload: Workload, counter: prompts.TokenCounter,
                 itl_targets: dict[str, float | None] | None = None, seed: int = 0,
                 ids: dict[int, list[int]] | None = None):
        """ids: a cache of plain requests' prompt ids by plan index (the same plan at another rate)."""
        self.sim, self.workload, self.counter = sim, workload, counter
        self.ids = {} if ids is None else ids
        self.itl_targets = itl_targets or {}
        self.seed = seed
        self.requests: list[SimRequest] = []  # every call, plain or a job's, in submission order
        self.jobs: list[SimJob] = []
        self._jobs: dict[str, tuple[SimJob, Call, str]] = {}  # a job call's request id -> (job, call, answer)
        sim.on_finish = self._finished

    def add_plan(self, plan: list[Planned]) -> None:
        """Every arrival of an open-loop plan (Planner.open_loop): requests at their offsets, jobs started then."""
        for p in plan:
            if p.job is None:
                if p.index not in self.ids:
                    self.ids[p.index] = self._prompt_ids(p)
                self._submit(p, f"sim-{p.index}", p.offset, None, ids=self.ids[p.index])
            else:
                job = SimJob(p, sent=p.offset)
                self.jobs.append(job)
                self.sim.call_at(p.offset, lambda t, job=job: self._next_call(job, t))

    def _prompt_ids(self, p: Planned) -> list[int]:
        return self.counter.prompt_ids(p.prompt, self.workload.lane(p.lane).endpoint, p.messages)

    def _submit(self, p: Planned, rid: str, t: float, answer_ids: list[int] | None, affinity: str | None = None,
                ids: list[int] | None = None) -> SimRequest:
        ids = self._prompt_ids(p) if ids is None else ids
        req = SimRequest(rid, p.lane, t, ids, p.max_tokens, output_ids=answer_ids,
                         itl_target=self.itl_targets.get(p.lane), affinity=affinity, tag=p)
        self.requests.append(req)
        self.sim.submit(req)
        return req

    # -- jobs ---------------------------------------------------------------------------------------
    def _next_call(self, job: SimJob, t: float) -> None:
        script = job.planned.job
        try:
            call = script.next_call(t)
        except ContextFull as e:
            job.error = str(e)
            self._end_job(job, t)
            return
        if call is None:
            self._end_job(job, t)
            return
        rng = np.random.default_rng([self.seed, 7, job.planned.index, call.turn])
        answer = prompts.words(rng, self.counter, call.max_tokens)  # EOS-free: the whole max_tokens
        answer_ids = self.counter.ids(answer) if self.counter.exact else prompts.estimated_ids(answer)
        rid = f"sim-{job.planned.index}-{call.turn}"
        self._jobs[rid] = (job, call, answer)
        job.calls.append(self._submit(call_planned(job.planned, call), rid, t, answer_ids,
                                      affinity=f"job-{job.planned.index}"))

    def _finished(self, req: SimRequest, t: float) -> None:
        if req.request_id not in self._jobs:
            return
        job, call, answer = self._jobs.pop(req.request_id)
        if req.error is not None:
            job.error = f"turn {call.turn} ({call.step}): {req.error}"
            self._end_job(job, t)
            return
        gate = call.gate_latency_s if call.kind == "step" else 0.0
        batch = job.planned.job.answered(call, answer, True)
        tools = [r.latency_s for r in batch.runs]
        tool = (max(tools) if batch.parallel else sum(tools)) if tools else 0.0
        job.planned.job.observed(batch)
        job.gate_s += gate
        job.tool_s += tool
        self.sim.call_at(t + gate + tool, lambda now: self._next_call(job, now))

    def _end_job(self, job: SimJob, t: float) -> None:
        script = job.planned.job
        gate = 0.0
        if job.error is None:
            job.steps_passed = script.passed_steps()
            gate = script.job_gate_latency_s()
        job.gate_s += gate
        job.finished = t + gate


def open_loop_plan(planner: Planner, requests: int | None, duration: float | None) -> list[Planned]:
    """The plan `twospeed bench` sends in open loop (its default of 40 requests when neither is given)."""
    if requests is None and duration is None:
        requests = 40
    return planner.open_loop(requests, duration)
