"""What a job calls next: the steps of a synthetic job (job_spec.py) or the recorded calls of a traced one.

A script hands the runner one `Call` at a time (`next_call`), is told each answer and its gate verdict
(`answered`, which returns the tool calls to make now), and then the tool results (`observed`). Draws (sizes,
tool latencies, loop stops) come from the job's own generator in call order, so a job is deterministic under
the run's seed given the same answers. Observation sizes are exact in the target's tokens; a `summarize`
policy caps what enters the history (cut to the head, or a model call whose answer replaces the dump).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from twospeed.lab import prompts
from twospeed.lab.job_prompt import History, Observation, Turn, summary_prompt
from twospeed.lab.job_spec import JobSpec, Step, Summarize
from twospeed.lab.workload import Dist, TraceCall


@dataclass(slots=True)
class Call:
    """One model call a job makes."""

    turn: int  # 1-based, in the job's order (summarize calls count)
    step: str  # the step's name, or "summarize"
    prompt: str | None  # completions
    messages: list[dict] | None  # chat
    max_tokens: int
    response_format: dict | None = None
    gate: dict = field(default_factory=lambda: {"type": "none"})
    gate_latency_s: float = 0.0  # slept while judging
    meta: dict = field(default_factory=dict)  # for the gate, plus "prefix" (the stable part of this prompt)
    observations: list[int] = field(default_factory=list)  # tokens of each tool result this prompt added
    kind: str = "step"  # "step" | "summarize"


@dataclass(slots=True)
class ToolRun:
    name: str
    latency_s: float  # drawn round trip


@dataclass(slots=True)
class ToolBatch:
    """The tools a step calls after its answer; their results enter the next prompt in this order."""

    runs: list[ToolRun] = field(default_factory=list)
    parallel: bool = True  # all at once (the batch takes the slowest) or one after another (the sum)


class SyntheticJob:
    """A job drawn from a lane's JobSpec."""

    def __init__(self, spec: JobSpec, endpoint: str, rng: np.random.Generator, counter: prompts.TokenCounter,
                 prefix: Callable[[float], str], scale: float = 1.0, summarize: Summarize | None = None,
                 max_prompt_tokens: int | None = None, max_output_tokens: int | None = None, shared: bool = True,
                 context_limit: Callable[[int], int | None] | None = None):
        self.spec, self.rng, self.counter, self.prefix = spec, rng, counter, prefix
        self.context_limit = context_limit  # max_tokens -> the longest prompt the server's context takes with it
        self.shared = shared  # the prefix is the lane's shared one (else this job's own: nothing to share)
        self.scale, self.summarize = scale, summarize
        self.max_prompt_tokens, self.max_output_tokens = max_prompt_tokens, max_output_tokens
        self.history = History(prompts.words(rng, counter, self._tokens(spec.task_tokens)), endpoint)
        self.step_index, self.iteration, self.turn = 0, 1, 0
        self.pending: list[Observation] = []  # results of the last step's tools, for the next prompt
        self.to_summarize: list[int] = []  # indexes into pending awaiting a model summary
        self.verdicts: dict[str, bool] = {}  # step name -> its last call's gate
        self.last_answer = ""

    def _tokens(self, dist: Dist) -> int:
        return max(1, round(dist.sample(self.rng) * self.scale))

    @property
    def step(self) -> Step | None:
        return self.spec.steps[self.step_index] if self.step_index < len(self.spec.steps) else None

    def next_call(self, at_s: float = 0.0) -> Call | None:
        """The next call, or None when the job is done. `at_s` (s since the run started) stamps an unstable
        prefix's clock."""
        if self.to_summarize:
            self.turn += 1
            return self._summary_call()
        step = self.step
        if step is None:
            return None
        self.turn += 1
        instruction = prompts.words(self.rng, self.counter, self._tokens(step.prompt_tokens))
        max_tokens = step.max_tokens.sample(self.rng)
        if self.max_output_tokens:
            max_tokens = min(max_tokens, self.max_output_tokens)
        observations, self.pending = self.pending, []
        if self.history.turns:
            self.history.turns[-1].observations = observations
        prefix = self.prefix(at_s)
        text, messages = self.history.prompt(prefix, step.name, instruction)
        latency = step.gate.latency_ms.sample(self.rng) / 1e3 if step.gate.latency_ms else 0.0
        call = Call(self.turn, step.name, text, messages, max_tokens, step.response_format, step.gate.config, latency,
                    {"tools": list(self.spec.tools), "prefix": prefix if self.shared else ""},
                    [o.tokens for o in observations])
        self.history.add(Turn(step.name, instruction))
        return self._capped(call)

    def _capped(self, call: Call) -> Call:
        """The call, unless its prompt is over --max-prompt-tokens or (with its max_tokens) the server's context:
        then the job ends here (ContextFull) instead of sending what the server would refuse."""
        context = self.context_limit(call.max_tokens) if self.context_limit else None
        if self.max_prompt_tokens is not None or context is not None:
            n = self.counter.billed(call.prompt or "", self.history.endpoint, call.messages)
            if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
                raise ContextFull(f"the job's history reached {n} prompt tokens, over --max-prompt-tokens "
                                  f"{self.max_prompt_tokens} (lower --scale, or summarize the dumps)")
            if context is not None and n > context:
                raise ContextFull(f"the job's history reached {n} prompt tokens, over the {context} the server's "
                                  f"context leaves beside max_tokens {call.max_tokens} (lower --scale, or summarize "
                                  f"the dumps)")
        return call

    def _summary_call(self) -> Call:
        obs = self.pending[self.to_summarize[0]]
        n = self.summarize.max_tokens
        return Call(self.turn, "summarize", summary_prompt(obs, n), None, n, kind="summarize",
                    meta={"prefix": ""}, observations=[obs.dump_tokens])

    def answered(self, call: Call, answer: str, gate_passed: bool) -> ToolBatch:
        """Record the answer; return the tools to call now (none after a summary)."""
        if call.kind == "summarize":
            i = self.to_summarize.pop(0)
            obs = self.pending[i]
            self.pending[i] = Observation(obs.tool, answer, self.counter.count(answer), obs.dump_tokens)
            return ToolBatch()
        self.history.turns[-1].answer = answer
        self.last_answer = answer
        step = self.step
        self.verdicts[step.name] = gate_passed
        tools = [ToolRun(name, self.spec.tools[name].latency_ms.sample(self.rng) / 1e3) for name in step.tools]
        self._advance(step, gate_passed)
        return ToolBatch(tools, step.parallel)

    def _advance(self, step: Step, gate_passed: bool) -> None:
        r = step.repeat
        if r is not None and self.iteration < r.max:
            done = gate_passed if r.until == "gate" else bool(self.rng.random() < r.done_probability)
            if not done:
                self.iteration += 1
                return
        self.step_index, self.iteration = self.step_index + 1, 1

    def observed(self, batch: ToolBatch) -> None:
        """The tools' results, in call order, enter the next prompt (summarized per the policy)."""
        for tool in batch.runs:
            dump = self._tokens(self.spec.tools[tool.name].observation_tokens)
            text, tokens = prompts.words(self.rng, self.counter, dump), dump
            s = self.summarize
            if s is not None and dump > s.max_tokens:
                if s.by == "model":
                    self.to_summarize.append(len(self.pending))
                else:
                    text, tokens = self.counter.truncate(text, s.max_tokens), s.max_tokens
            self.pending.append(Observation(tool.name, text, tokens, dump))

    def passed_steps(self) -> bool:
        """Every step ran and its last call passed its gate."""
        return len(self.verdicts) == len(self.spec.steps) and all(self.verdicts.values())

    def job_gate(self) -> dict:
        return self.spec.gate.config

    def job_gate_latency_s(self) -> float:
        g = self.spec.gate.latency_ms
        return g.sample(self.rng) / 1e3 if g else 0.0


class RecordedJob:
    """A traced job: its calls as recorded, each followed by its recorded tool time."""

    def __init__(self, calls: list[TraceCall], max_output_tokens: int | None = None,
                 cut: Callable[[str, int], str] | None = None):
        self.calls, self.turn, self.max_output_tokens = calls, 0, max_output_tokens
        self.cut = cut  # (prompt, max_tokens) -> the prompt cut to fit the server's context
        self.last_answer = ""

    def next_call(self, at_s: float = 0.0) -> Call | None:
        if self.turn >= len(self.calls):
            return None
        c = self.calls[self.turn]
        self.turn += 1
        max_tokens = min(c.max_tokens, self.max_output_tokens) if self.max_output_tokens else c.max_tokens
        prompt = self.cut(c.prompt, max_tokens) if self.cut else c.prompt
        return Call(self.turn, f"turn{self.turn}", prompt, None, max_tokens, meta={"prefix": ""})

    def answered(self, call: Call, answer: str, gate_passed: bool) -> ToolBatch:
        self.last_answer = answer
        tool_s = self.calls[call.turn - 1].tool_s
        return ToolBatch([ToolRun("trace", tool_s)] if tool_s > 0 else [])

    def observed(self, batch: ToolBatch) -> None:
        pass

    def passed_steps(self) -> bool:
        return True

    def job_gate(self) -> dict:
        return {"type": "none"}

    def job_gate_latency_s(self) -> float:
        return 0.0


class ContextFull(ValueError):
    """The job's next prompt would be over --max-prompt-tokens: the job ends with this error."""
