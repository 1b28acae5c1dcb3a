"""The `job` lane kind: what one agent job does, as the workload's YAML says it (validated here).

A job is a sequence of steps (e.g. gather -> act -> verify), each one model call whose prompt is the job's
history so far; a step may call tools after its answer (one after another, or in parallel, their results
concatenated into the next prompt in call order) and may repeat until its gate passes or a drawn stop. The
lane's `job:` block:

    job:
      window_s: 60                     # the job must finish inside this (goodput)
      task_tokens: {dist: uniform, min: 60, max: 150}    # the user's request, first in the history
      summarize: {max_tokens: 512, by: truncate}         # optional: tool dumps over N tokens enter as N
      gate: {type: json}               # optional job-level gate, on the final answer
      tools:
        search: {latency_ms: {dist: lognormal, median: 400, min: 50, max: 3000}, observation_tokens: 5000}
      steps:
        - {name: gather, prompt_tokens: 40, max_tokens: 64, tools: [search, lookup], parallel: true,
           gate: {type: json_schema, schema: {...}, latency_ms: 20}, response_format: {...}}
        - {name: verify, prompt_tokens: 30, max_tokens: 32, repeat: {max: 3, until: gate}}

Gates are the lab's (twospeed/lab/gates.py); a gate's optional `latency_ms` is how long judging takes (a
validator, a test run) and is slept, so a slow gate shows as gate time, never as decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twospeed.lab import gates
from twospeed.lab.workload import Dist

SUMMARIZE_BY = ("truncate", "model")
REPEAT_UNTIL = ("gate", "drawn")


@dataclass(slots=True)
class Tool:
    """A tool a step calls: how long the round trip takes and how much text it returns."""

    name: str
    latency_ms: Dist  # drawn per call, milliseconds
    observation_tokens: Dist  # the size of its result in the next prompt, tokens


@dataclass(slots=True)
class Gate:
    """A lab gate (gates.py config) and how long judging takes."""

    config: dict = field(default_factory=lambda: {"type": "none"})
    latency_ms: Dist | None = None  # slept per judgement (milliseconds); None: only the check's own time

    @classmethod
    def parse(cls, value: dict | None, what: str) -> "Gate":
        config = dict(value or {"type": "none"})
        latency = config.pop("latency_ms", None)
        try:
            gates.check_config(config)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        return cls(config, None if latency is None else Dist.parse(latency, f"{what}: latency_ms"))


@dataclass(slots=True)
class Repeat:
    """A loop step: run it again until its gate passes (`gate`) or a drawn stop (`drawn`), at most `max` times."""

    max: int = 3
    until: str = "gate"
    done_probability: float = 0.5  # `drawn`: chance each iteration is the last

    def __post_init__(self) -> None:
        if self.max < 1 or self.until not in REPEAT_UNTIL or not 0 < self.done_probability <= 1:
            raise ValueError(f"repeat: need max >= 1, until in {REPEAT_UNTIL}, 0 < done_probability <= 1")


@dataclass(slots=True)
class Step:
    """One model call of the job (more with `repeat`)."""

    name: str
    prompt_tokens: Dist  # the step's instruction appended to the history, tokens
    max_tokens: Dist  # the answer's cap
    tools: list[str] = field(default_factory=list)  # called after the answer; results go into the next prompt
    parallel: bool = True  # several tools at once (their time is the slowest) or one after another
    gate: Gate = field(default_factory=Gate)
    response_format: dict | None = None  # sent as is (structured output)
    repeat: Repeat | None = None


@dataclass(slots=True)
class Summarize:
    """The harness's policy for tool dumps: results over `max_tokens` enter the history as `max_tokens` tokens,
    cut to their head (`truncate`) or summarized by a model call of that length (`model`)."""

    max_tokens: int
    by: str = "truncate"

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.by not in SUMMARIZE_BY:
            raise ValueError(f"summarize: need max_tokens >= 1 and by in {SUMMARIZE_BY}")

    def as_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "by": self.by}


@dataclass(slots=True)
class JobSpec:
    steps: list[Step]
    tools: dict[str, Tool] = field(default_factory=dict)
    task_tokens: Dist = field(default_factory=lambda: Dist("fixed", 64, 64))
    window_s: float | None = None  # the job's completion window (goodput needs it met)
    gate: Gate = field(default_factory=Gate)  # on the final answer
    summarize: Summarize | None = None

    def gates(self) -> list[dict]:
        return [self.gate.config, *(s.gate.config for s in self.steps)]


STEP_KEYS = {"name", "prompt_tokens", "max_tokens", "tools", "parallel", "gate", "response_format", "repeat"}
JOB_KEYS = {"steps", "tools", "task_tokens", "window_s", "gate", "summarize"}


def _step(d: dict, lane: str, default_max: Dist, tools: dict[str, Tool]) -> Step:
    name = d.get("name")
    what = f"lane {lane}: step {name!r}"
    if not name:
        raise ValueError(f"lane {lane}: every job step needs a name")
    unknown = set(d) - STEP_KEYS
    if unknown:
        raise ValueError(f"{what}: unknown keys {sorted(unknown)}; expected {sorted(STEP_KEYS)}")
    called = list(d.get("tools") or [])
    missing = [t for t in called if t not in tools]
    if missing:
        raise ValueError(f"{what}: tools {missing} are not defined under job.tools")
    repeat = d.get("repeat")
    return Step(name=str(name), prompt_tokens=Dist.parse(d.get("prompt_tokens", 32), f"{what}: prompt_tokens"),
                max_tokens=Dist.parse(d["max_tokens"], f"{what}: max_tokens") if "max_tokens" in d else default_max,
                tools=called, parallel=bool(d.get("parallel", True)), gate=Gate.parse(d.get("gate"), f"{what}: gate"),
                response_format=d.get("response_format"), repeat=None if repeat is None else Repeat(**repeat))


def parse_job(d: dict | None, lane: str, default_max: Dist) -> JobSpec:
    """The `job:` block of a lane; errors name the lane and the step."""
    if not isinstance(d, dict) or not d.get("steps"):
        raise ValueError(f"lane {lane}: a job lane needs a job: block with a list of steps")
    unknown = set(d) - JOB_KEYS
    if unknown:
        raise ValueError(f"lane {lane}: job: unknown keys {sorted(unknown)}; expected {sorted(JOB_KEYS)}")
    tools = {}
    for name, t in (d.get("tools") or {}).items():
        t = t or {}
        tools[name] = Tool(name, Dist.parse(t.get("latency_ms", 0), f"lane {lane}: tool {name}: latency_ms"),
                           Dist.parse(t.get("observation_tokens", 64), f"lane {lane}: tool {name}: observation_tokens"))
    steps = [_step(s, lane, default_max, tools) for s in d["steps"]]
    names = [s.name for s in steps]
    if len(set(names)) != len(names):
        raise ValueError(f"lane {lane}: job step names must be unique, got {names}")
    summarize = d.get("summarize")
    window = d.get("window_s")
    return JobSpec(steps=steps, tools=tools, task_tokens=Dist.parse(d.get("task_tokens", 64), f"lane {lane}: task_tokens"),
                   window_s=None if window is None else float(window), gate=Gate.parse(d.get("gate"), f"lane {lane}: job gate"),
                   summarize=None if not summarize else Summarize(**summarize))
