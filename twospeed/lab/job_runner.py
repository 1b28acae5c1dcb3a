"""Run one agent job against the server: its calls strictly one after another, tool round trips and gates
between them, every part timed.

The runner asks the job's script (job_script.py) for a call, sends it (the bench's `send`, a streamed request
timed token by token), judges the answer with the step's gate (the check plus the gate's drawn latency: gate
time), runs the tools the script asks for (their drawn latencies slept, in parallel or one after another:
tool time), hands their results back, and repeats; last, the job-level gate on the final answer. The job's
wall time runs from its first send to the end of that last gate; job_results.py splits it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from twospeed.lab import gates
from twospeed.lab.client import Response
from twospeed.lab.job_script import Call, ContextFull, ToolBatch
from twospeed.lab.schedule import Planned


@dataclass(slots=True)
class CallInfo:
    """Which job a call belongs to, and where in it."""

    job: int  # the job's index (its arrival in the plan)
    turn: int  # 1-based
    step: str
    kind: str  # "step" | "summarize"
    observations: list[int]  # tokens of each tool result this prompt added (a summary call: the dump it reads)

    @property
    def observation_tokens(self) -> int:
        return sum(self.observations)


@dataclass(slots=True)
class JobRun:
    """One job as it ran (times in s from the run start)."""

    planned: Planned
    sent: float  # the first call went out
    finished: float = 0.0  # the last gate was done
    calls: list[Response] = field(default_factory=list)
    tool_s: float = 0.0  # time in tool round trips
    gate_s: float = 0.0  # time judging (steps and the job gate)
    steps_passed: bool = False  # every step ran and its last call passed its gate
    job_gate: gates.GateResult = field(default_factory=lambda: gates.GateResult(False, "not run"))
    error: str | None = None


async def run_tools(batch: ToolBatch) -> float:
    """Wait out the tools' latencies (parallel: the slowest; else their sum); returns the seconds spent."""
    t0 = time.perf_counter()
    if batch.parallel:
        await asyncio.gather(*(asyncio.sleep(t.latency_s) for t in batch.runs))
    else:
        for t in batch.runs:
            await asyncio.sleep(t.latency_s)
    return time.perf_counter() - t0 if batch.runs else 0.0


async def judge(config: dict, text: str, meta: dict, latency_s: float) -> tuple[gates.GateResult, float]:
    """A gate's verdict and the time it took (its check plus its latency)."""
    t0 = time.perf_counter()
    verdict = gates.run_gate(config, text, meta)
    if latency_s > 0:
        await asyncio.sleep(latency_s)
    return verdict, time.perf_counter() - t0


def call_planned(job: Planned, call: Call) -> Planned:
    info = CallInfo(job.index, call.turn, call.step, call.kind, call.observations)
    meta = {**call.meta, "gate": call.gate}  # the step's gate, for the record's needed-tokens estimate
    return Planned(job.index, job.lane, None, call.prompt or "", call.max_tokens, meta, messages=call.messages,
                   response_format=call.response_format, turn=info)


async def run_job(job: Planned, send: Callable[[Planned], Awaitable[Response]], run_start: float) -> JobRun:
    """Run `job` (a Planned arrival whose .job is its script) to its end; never raises for the server's errors."""
    script = job.job
    run = JobRun(job, time.perf_counter() - run_start)
    while True:
        try:
            call = script.next_call(time.perf_counter() - run_start)
        except ContextFull as e:
            run.error = str(e)
            break
        if call is None:
            break
        resp = await send(call_planned(job, call))
        run.calls.append(resp)
        if resp.error is not None:
            run.error = f"turn {call.turn} ({call.step}): {resp.error}"
            break
        if call.kind == "step":
            resp.gate, spent = await judge(call.gate, resp.text, call.meta, call.gate_latency_s)
            run.gate_s += spent
        batch = script.answered(call, resp.text, resp.gate.passed if resp.gate else True)
        run.tool_s += await run_tools(batch)
        script.observed(batch)
    if run.error is None:
        run.steps_passed = script.passed_steps()
        run.job_gate, spent = await judge(script.job_gate(), script.last_answer, {}, script.job_gate_latency_s())
        run.gate_s += spent
    run.finished = time.perf_counter() - run_start
    return run
