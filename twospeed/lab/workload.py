"""Workloads: a mix of lanes, each with its own arrival process, prompt shape, lengths, SLO, gate and price.

A workload is YAML (the built-ins live in twospeed/lab/workloads/: agent, rag, chat, nightly, mixed,
agent-jobs; copy one and edit it) or a JSONL trace (one request per line with its send time; lines with a
`job` id are the calls of one agent job). `load_workload` turns either into a `Workload` of `Lane`
dataclasses, validated here so a typo fails before any traffic is sent. A `job` lane's steps are parsed by
job_spec.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from twospeed.schema.price import Price
from twospeed.schema.slo import DEFAULT_LANE, LaneSLO

if TYPE_CHECKING:
    from twospeed.lab.job_spec import JobSpec

BUILTIN = ("agent", "rag", "chat", "nightly", "mixed", "agent-jobs", "regression", "tasks")
PROMPT_KINDS = ("agent", "rag", "chat", "nightly", "trace", "job")
PROMPT_SOURCES = ("synthetic", "task")  # word salad of the right shape (prompts.py), or the task corpus (task_prompts.py)
# Harness policies: how the client builds prompts, not what the traffic is. Runs that differ only in these
# stay comparable (the workload digest leaves them out): a stable vs an unstable system block, dumps
# summarized or not.
POLICY_KEYS = ("prefix_stable",)
JOB_POLICY_KEYS = ("summarize",)
ARRIVALS = ("poisson", "gamma", "constant")


@dataclass(slots=True)
class Dist:
    """A length distribution in tokens: fixed (min == max), uniform, or lognormal clipped to [min, max]."""

    kind: str = "uniform"  # "fixed" | "uniform" | "lognormal"
    min: int = 1
    max: int = 1
    median: float | None = None  # lognormal: the median (tokens)
    sigma: float = 0.5  # lognormal: spread of log(length)

    @classmethod
    def parse(cls, value: Any, what: str) -> "Dist":
        if isinstance(value, int) and not isinstance(value, bool):
            return cls("fixed", value, value)
        if not isinstance(value, dict):
            raise ValueError(f"{what}: expected a number of tokens or {{dist, min, max}}, got {value!r}")
        d = cls(kind=value.get("dist", "uniform"), min=int(value["min"]), max=int(value["max"]),
                median=value.get("median"), sigma=float(value.get("sigma", 0.5)))
        if d.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"{what}: dist must be fixed, uniform or lognormal, got {d.kind!r}")
        if not 0 <= d.min <= d.max:
            raise ValueError(f"{what}: need 0 <= min <= max, got {d.min}..{d.max}")
        return d

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed" or self.min == self.max:
            return self.min
        if self.kind == "uniform":
            return int(rng.integers(self.min, self.max + 1))
        median = self.median or (self.min + self.max) / 2
        return int(np.clip(round(rng.lognormal(np.log(median), self.sigma)), self.min, self.max))

    def scaled(self, factor: float) -> "Dist":
        return dataclasses.replace(self, min=max(1, round(self.min * factor)), max=max(1, round(self.max * factor)),
                                   median=None if self.median is None else self.median * factor)


@dataclass(slots=True)
class Arrival:
    """How a lane's requests arrive: Poisson, gamma (burstiness = coefficient of variation of the gaps; 1 is
    Poisson, >1 bursty, <1 regular) or constant spacing. `rate` is requests/s for this lane."""

    process: str = "poisson"
    rate: float = 1.0
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.process not in ARRIVALS:
            raise ValueError(f"arrival process must be one of {ARRIVALS}, got {self.process!r}")
        if not self.rate > 0 or not self.burstiness > 0:
            raise ValueError(f"arrival rate and burstiness must be > 0, got {self.rate}, {self.burstiness}")


@dataclass(slots=True)
class Lane:
    """One kind of traffic: its share of the load, prompt shape, lengths, objectives and gate. The billed prompt
    is prefix_tokens + prompt_tokens exactly (salt, BOS and chat wrapper inside) when the tokenizer is known."""

    name: str
    kind: str  # prompt shape: agent | rag | chat | nightly | trace | job
    share: float = 1.0  # fraction of the workload's requests (normalised over lanes)
    arrival: Arrival = field(default_factory=Arrival)
    prompt_tokens: Dist = field(default_factory=lambda: Dist("fixed", 64, 64))  # the new (unshared) part
    prefix_tokens: int = 0  # the lane's byte-stable shared prefix (system block + tool schemas)
    prefix_reuse: float = 1.0  # probability a request starts with the shared prefix (else a fresh one)
    max_tokens: Dist = field(default_factory=lambda: Dist("fixed", 64, 64))
    slo: LaneSLO = field(default_factory=lambda: LaneSLO.from_workload(DEFAULT_LANE, None))  # the lane's name once parsed
    gate: dict = field(default_factory=lambda: {"type": "none"})
    endpoint: str = "completions"  # "completions" | "chat"
    temperature: float = 0.0
    response_format: dict | None = None  # sent as is (structured output), when the server supports it
    prefix_stable: bool = True  # False: the system block carries the send time (as careless harnesses do)
    job: "JobSpec | None" = None  # kind job: the steps, tools, window and policies of one job
    prompts: str = "synthetic"  # "synthetic" | "task": the task corpus' formats, which `demo-task` has learnt

    def __post_init__(self) -> None:
        if self.kind not in PROMPT_KINDS:
            raise ValueError(f"lane {self.name!r}: kind must be one of {PROMPT_KINDS}, got {self.kind!r}")
        if (self.kind == "job") != (self.job is not None):
            raise ValueError(f"lane {self.name!r}: a job: block goes with kind: job, and kind job needs one")
        if self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"lane {self.name!r}: prompts must be one of {PROMPT_SOURCES}, got {self.prompts!r}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"lane {self.name!r}: endpoint must be completions or chat, got {self.endpoint!r}")
        if not 0 <= self.prefix_reuse <= 1 or self.share <= 0:
            raise ValueError(f"lane {self.name!r}: need 0 <= prefix_reuse <= 1 and share > 0")

    def gates(self) -> list[dict]:
        """Every gate config of the lane (a job's steps and job gate too)."""
        return [self.gate, *(self.job.gates() if self.job else [])]


@dataclass(slots=True)
class TraceCall:
    """One recorded call of a traced job: its prompt as the harness built it, and the tool time after it."""

    prompt: str
    max_tokens: int
    tool_s: float = 0.0


@dataclass(slots=True)
class TraceItem:
    """One arrival of a replayed trace: send offset (s), lane, prompt text, max_tokens; a traced job has its
    calls instead (sent one after another, each after the previous answer and its tool time)."""

    t: float
    lane: str
    prompt: str
    max_tokens: int
    job: str | None = None
    calls: list[TraceCall] | None = None


@dataclass(slots=True)
class Workload:
    name: str
    lanes: list[Lane]
    description: str = ""
    price: Price = field(default_factory=Price)
    trace: list[TraceItem] | None = None  # replay these instead of sampling arrivals
    source: dict = field(default_factory=dict)  # the parsed YAML (or a trace summary), kept in results.json

    @property
    def digest(self) -> str:
        """Identifies the workload's content, so `compare` can refuse runs of different workloads."""
        blob = json.dumps({"source": _without_policy(self.source),
                           "trace": [dataclasses.astuple(t) for t in self.trace or []]}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def lane(self, name: str) -> Lane:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)


def _without_policy(source: dict) -> dict:
    """The workload's content less the harness policies (POLICY_KEYS), for the digest."""
    if not isinstance(source.get("lanes"), list):
        return source
    lanes = []
    for lane in source["lanes"]:
        lane = {k: v for k, v in lane.items() if k not in POLICY_KEYS}
        if isinstance(lane.get("job"), dict):
            lane["job"] = {k: v for k, v in lane["job"].items() if k not in JOB_POLICY_KEYS}
        lanes.append(lane)
    return {**source, "lanes": lanes}


def _lane(d: dict) -> Lane:
    d = dict(d)
    name = d.pop("name", None)
    if not name:
        raise ValueError("every lane needs a name")
    known = {f.name for f in dataclasses.fields(Lane)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"lane {name!r}: unknown keys {sorted(unknown)}")
    arrival = d.pop("arrival", {}) or {}
    max_tokens = Dist.parse(d.pop("max_tokens", 64), f"lane {name}: max_tokens")
    job = None
    if "job" in d:
        from twospeed.lab.job_spec import parse_job

        job = parse_job(d.pop("job"), name, max_tokens)
    return Lane(name=name, kind=d.pop("kind", "chat"), arrival=Arrival(**arrival),
                prompt_tokens=Dist.parse(d.pop("prompt_tokens", 64), f"lane {name}: prompt_tokens"),
                max_tokens=max_tokens, slo=LaneSLO.from_workload(name, d.pop("slo", None)), gate=d.pop("gate", None) or {"type": "none"},
                job=job, **d)


def parse_workload(doc: dict) -> Workload:
    if not isinstance(doc, dict) or not doc.get("lanes"):
        raise ValueError("a workload needs a 'lanes' list")
    lanes = [_lane(x) for x in doc["lanes"]]
    names = [lane.name for lane in lanes]
    if len(set(names)) != len(names):
        raise ValueError(f"lane names must be unique, got {names}")
    return Workload(name=str(doc.get("name", "custom")), lanes=lanes, description=doc.get("description", ""),
                    price=Price.parse(doc.get("price")), source=doc)


def load_trace(path: Path) -> Workload:
    """JSONL, one request a line: {"t": seconds from start, "prompt": text, "max_tokens": n, "lane": name}.
    Lines with a "job" id (and "turn", optional "tool_s": tool time after that call) are one job's calls: the job
    arrives at its first turn's t and the lab sends its calls in turn order, each after the previous one."""
    items: list[TraceItem] = []
    jobs: dict[str, list[tuple[int, float, TraceItem]]] = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            item = TraceItem(float(d["t"]), str(d.get("lane", "trace")), str(d["prompt"]), int(d.get("max_tokens", 64)))
            if "job" in d:
                jobs.setdefault(str(d["job"]), []).append((int(d.get("turn", 0)), float(d.get("tool_s", 0.0)), item))
            else:
                items.append(item)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: expected {{t, prompt, max_tokens?, lane?, job?, turn?, tool_s?}}: {e}") from None
    for job, calls in jobs.items():
        calls.sort(key=lambda c: (c[0], c[2].t))
        first = calls[0][2]
        items.append(TraceItem(min(c[2].t for c in calls), first.lane, "", 0, job,
                               [TraceCall(c[2].prompt, c[2].max_tokens, c[1]) for c in calls]))
    if not items:
        raise ValueError(f"{path}: empty trace")
    items.sort(key=lambda x: x.t)
    lanes = [Lane(name=n, kind="trace") for n in dict.fromkeys(x.lane for x in items)]
    return Workload(name=path.stem, lanes=lanes, description=f"trace replay of {path.name}", trace=items,
                    source={"trace": path.name, "requests": sum(x.calls is None for x in items), "jobs": len(jobs)})


def load_workload(spec: str) -> Workload:
    """A built-in name (BUILTIN), a YAML file, or a JSONL trace."""
    if spec in BUILTIN:
        text = resources.files("twospeed.lab").joinpath("workloads", f"{spec}.yaml").read_text()
        return parse_workload(yaml.safe_load(text))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"workload {spec!r}: not a built-in ({', '.join(BUILTIN)}) nor a file")
    if path.suffix == ".jsonl":
        return load_trace(path)
    try:
        return parse_workload(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, TypeError, KeyError, AttributeError) as e:  # a missing or misspelt field
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None
