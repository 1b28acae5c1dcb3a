"""The run plan: which request of which lane goes out when, with which prompt.

Each lane's arrivals are drawn from its own process at its share of the rate; each request's prompt is drawn
from a generator seeded by (seed, lane, index), so a request's bytes do not depend on the order in which the
plan is built (closed-loop runs build prompts lazily). `--scale` multiplies every prompt length and
`max_prompt_tokens` caps each prompt, so every workload fits a small-context model; a `fit` (fit.py, from the
context the server states) scales some lanes on their own and caps each prompt at the context less its own
max_tokens. With the target's tokenizer
a prompt bills exactly prefix_tokens + prompt_tokens (salt, BOS and chat wrapper inside the count), as the
peers' random datasets do. A job lane's arrival is a job: its script (job_script.py) builds each call's
prompt from the job's history while it runs. The harness policies (a stable or clock-stamped system block,
summarized dumps) can be overridden for a run without changing the workload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twospeed.lab import arrivals, prompts, task_prompts
from twospeed.lab.fit import Fit
from twospeed.lab.job_prompt import system_block
from twospeed.lab.job_script import RecordedJob, SyntheticJob
from twospeed.lab.job_spec import Summarize
from twospeed.lab.workload import PROMPT_SOURCES, Lane, Workload

FIT_ROUNDS = 8  # rebuilds to land a prompt on its exact token count (BPE merges at the seams shift it by a few)
PAD_MIN = 4  # a padding line needs this many tokens of room


@dataclass(slots=True)
class PlanConfig:
    seed: int = 0
    salt: str = ""  # first line of every prompt: a fresh one defeats caches left by earlier runs
    scale: float = 1.0  # multiplies prompt lengths (prefix and new part)
    max_prompt_tokens: int | None = None  # cap per prompt (tokens of --tokenizer, else estimated)
    rate: float | None = None  # total requests/s, split over lanes by share; None = the lanes' own rates
    max_output_tokens: int | None = None  # cap on every request's max_tokens (shorter runs)
    summarize_dumps: int | None = None  # job lanes: cap tool dumps at this many tokens (0 = off; None = the workload's)
    unstable_prefix: bool = False  # stamp the send time into every shared prefix (defeats the prefix cache)
    prompts: str | None = None  # every lane's prompt source ("synthetic" | "task"); None = each lane's own
    fit: Fit | None = None  # the workload fitted to the server's context: per-lane scales, per-request caps

    def __post_init__(self) -> None:
        if self.prompts is not None and self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"--prompts must be one of {PROMPT_SOURCES}, got {self.prompts!r}")
        if not self.scale > 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 32:
            raise ValueError(f"--max-prompt-tokens must be >= 32, got {self.max_prompt_tokens}")
        if self.summarize_dumps is not None and self.summarize_dumps < 0:
            raise ValueError(f"--summarize-dumps must be >= 0 tokens, got {self.summarize_dumps}")


@dataclass(slots=True)
class Planned:
    index: int
    lane: str
    offset: float | None  # intended send time (s from start); None in closed loop
    prompt: str
    max_tokens: int
    meta: dict = field(default_factory=dict)  # for gates; "prefix": the shared prefix it starts with ("" if none)
    messages: list[dict] | None = None  # a job's chat call: the conversation (else the prompt is one user message)
    response_format: dict | None = None  # a job step's own (a job call never uses the lane's)
    job: Any = None  # an arrival that is a job: its script (SyntheticJob or RecordedJob)
    turn: Any = None  # a call made by a job: its job_runner.CallInfo


class Planner:
    """Builds prompts for a workload under a PlanConfig; holds each lane's shared prefix."""

    def __init__(self, workload: Workload, config: PlanConfig, counter: prompts.TokenCounter):
        self.workload, self.config, self.counter = workload, config, counter
        total = sum(lane.share for lane in workload.lanes)
        self.shares = {lane.name: lane.share / total for lane in workload.lanes}
        self.salt = f"[run {config.salt}]\n" if config.salt else ""
        self.prefixes = {lane.name: self._prefix(lane, i, None) for i, lane in enumerate(workload.lanes)}
        self.turns: dict[str, int] = {}
        self.overhead: dict[str, int] = {}  # per lane: billed tokens beyond prefix + new part (template, BOS, salt)

    def scale(self, lane: Lane) -> float:
        """The lane's prompt scale: --scale, or what fitting it to the server's context left."""
        fit = self.config.fit
        return fit.scale(lane.name, self.config.scale) if fit is not None else self.config.scale

    def limit(self, max_tokens: int) -> int | None:
        """The longest prompt a request with this max_tokens may send: --max-prompt-tokens and the context."""
        caps = [c for c in (self.config.max_prompt_tokens,
                            self.config.fit.limit(max_tokens) if self.config.fit else None) if c is not None]
        return min(caps) if caps else None

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, *key])

    def source(self, lane: Lane):
        """The module that writes this lane's prompts: prompts (synthetic) or task_prompts (the task corpus)."""
        return task_prompts if (self.config.prompts or lane.prompts) == "task" else prompts

    def _prefix(self, lane: Lane, lane_idx: int, request: int | None) -> str:
        """The salt line + the lane's shared block, fitted to prefix_tokens billed tokens (BOS inside)."""
        key = (lane_idx, 1) if request is None else (lane_idx, 2, request)
        want = round(lane.prefix_tokens * self.scale(lane))
        if want <= 0:
            return self.salt
        asked, text = want, ""
        for _ in range(FIT_ROUNDS):
            rng = self._rng(*key)
            block = (system_block(rng, self.counter, asked, list(lane.job.tools)) if lane.job else
                     self.source(lane).shared_prefix(lane.kind, rng, self.counter, asked))
            text = self.salt + block
            n = self.counter.billed(text)
            if n == want or asked <= 1:
                break
            asked = max(1, asked + want - n)
        return text

    # -- harness policies -------------------------------------------------------------------------
    def prefix_stable(self, lane: Lane) -> bool:
        return lane.prefix_stable and not self.config.unstable_prefix

    def summarize(self, lane: Lane) -> Summarize | None:
        """The job lane's dump policy: --summarize-dumps overrides the workload's (0 turns it off)."""
        own = lane.job.summarize if lane.job else None
        n = self.config.summarize_dumps
        if n is None:
            return own
        return Summarize(n, own.by if own else "truncate") if n > 0 else None

    def policy(self, lane: Lane) -> dict:
        """What the harness did for this lane, for results.json and compare."""
        s = self.summarize(lane)
        return {"prefix_stable": self.prefix_stable(lane), "summarize": s.as_dict() if s else None}

    def _stamped(self, prefix: str, seconds: float) -> str:
        """The prefix with the send time after the salt line, as a harness that dates its system block sends."""
        clock = f"Current time: 2026-12-01 {9 + int(seconds // 3600) % 15:02d}:{int(seconds // 60) % 60:02d}:" \
                f"{seconds % 60:06.3f}\n"
        return self.salt + clock + prefix[len(self.salt):]

    def _prefix_at(self, lane: Lane, shared: str) -> Callable[[float], str]:
        """The job's prefix as a function of the send time (constant when the prefix is stable)."""
        return (lambda t: shared) if self.prefix_stable(lane) else (lambda t: self._stamped(shared, t))

    def lane_rate(self, lane: Lane) -> float:
        return self.config.rate * self.shares[lane.name] if self.config.rate else lane.arrival.rate

    def build(self, index: int, lane_name: str, offset: float | None) -> Planned:
        """Request (or job) `index` of `lane_name`: deterministic in (seed, lane, index)."""
        if self.workload.trace is not None:
            item = self.workload.trace[index]
            lane = self.workload.lane(item.lane)
            if item.calls is not None:
                return Planned(index, item.lane, offset, "", 0, job=RecordedJob(
                    item.calls, self.config.max_output_tokens, lambda text, m: self.cut(text, m, lane.endpoint)))
            return Planned(index, item.lane, offset, self.cut(item.prompt, item.max_tokens, lane.endpoint),
                           item.max_tokens)
        lane_idx = next(i for i, lane in enumerate(self.workload.lanes) if lane.name == lane_name)
        lane = self.workload.lanes[lane_idx]
        rng = self._rng(lane_idx, 3, index)
        shared = rng.random() < lane.prefix_reuse
        prefix = self.prefixes[lane.name] if shared else self._prefix(lane, lane_idx, index)
        if lane.job is not None:
            return Planned(index, lane.name, offset, "", 0, job=SyntheticJob(
                lane.job, lane.endpoint, rng, self.counter, self._prefix_at(lane, prefix) if shared else lambda t: prefix,
                self.scale(lane), self.summarize(lane), self.config.max_prompt_tokens, self.config.max_output_tokens,
                shared, self.config.fit.limit if self.config.fit else None))
        if shared and not self.prefix_stable(lane):
            prefix = self._stamped(prefix, offset if offset is not None else float(index))
        new = max(1, round(lane.prompt_tokens.sample(rng) * self.scale(lane)))
        max_tokens = lane.max_tokens.sample(rng)
        if self.config.max_output_tokens:
            max_tokens = min(max_tokens, self.config.max_output_tokens)
        turn = self.turns[lane.name] = self.turns.get(lane.name, 0) + 1
        state = rng.bit_generator.state

        def make(pad: str, body: int) -> prompts.Prompt:
            rng.bit_generator.state = state
            return self.source(lane).BUILDERS[lane.kind](rng, self.counter, prefix + pad, body, turn)

        prefix_tokens = round(lane.prefix_tokens * self.scale(lane))
        cap = self.limit(max_tokens)
        asked = prefix_tokens + new if cap is None else min(prefix_tokens + new, cap)
        p, n = self._fit(lane, make, prefix_tokens, asked, cap)
        return Planned(index, lane.name, offset, p.text, max_tokens,
                       {**p.meta, "prefix": prefix if shared else "", "prompt_tokens": n, "prompt_tokens_asked": asked})

    def cut(self, text: str, max_tokens: int, endpoint: str) -> str:
        """A trace's prompt cut to fit the context with its max_tokens (as recorded when it fits)."""
        cap = self.limit(max_tokens)
        for _ in range(FIT_ROUNDS):
            n = self.counter.billed(text, endpoint) if cap is not None else 0
            if cap is None or n <= cap:
                return text
            text = self.counter.truncate(text, max(1, self.counter.count(text) - (n - cap)))
        return text

    def _fit(self, lane: Lane, make: Callable[[str, int], prompts.Prompt], prefix_tokens: int,
             target: int, cap: int | None) -> tuple[prompts.Prompt, int]:
        """The prompt billing `target` tokens. First the new part is resized by the miss; where a builder's
        structure shifts with the size (rag's passage count) and jumps over the target, a padding line of the
        missing tokens goes between the prefix and the new part. Exact with the target's tokenizer, unless the
        lane asks for fewer tokens than its prefix and template take (then the smallest prompt; the run's summary
        counts such prompts). No prompt over `cap` is returned. Returns the prompt and its billed tokens."""
        tried: dict[tuple[int, int], tuple[prompts.Prompt, int]] = {}

        def attempt(body: int, pad: int = 0) -> int:
            if (body, pad) not in tried:
                filler = f"{prompts.words(np.random.default_rng(pad), self.counter, pad)}\n" if pad else ""
                p = make(filler, body)
                tried[body, pad] = (p, self.counter.billed(p.text, lane.endpoint))
            return tried[body, pad][1]

        # start from the template overhead the lane's last prompt had: most prompts then fit at once
        body = max(1, target - prefix_tokens - self.overhead.get(lane.name, 0))
        for _ in range(FIT_ROUNDS):
            n = attempt(body)
            if n == target or (n > target and body <= 1):
                break
            body = max(1, body + target - n)
        self.overhead[lane.name] = max(0, n - body - prefix_tokens)
        under = [k for k, (_, n) in tried.items() if n < target - PAD_MIN]
        if self.counter.exact and not any(n == target for _, n in tried.values()) and under:
            body = max(under, key=lambda k: tried[k][1])[0]
            pad = target - tried[body, 0][1] - 1  # the newline costs a token
            for _ in range(FIT_ROUNDS // 2):
                n = attempt(body, max(1, pad))
                if n == target:
                    break
                pad += target - n
        fits = [pn for pn in tried.values() if cap is None or pn[1] <= cap]
        if not fits:
            raise ValueError(f"lane {lane.name!r}: the shared prefix alone is over the {cap}-token prompt cap "
                             f"(--max-prompt-tokens, or the context less max_tokens); lower --scale")
        return min(fits, key=lambda pn: abs(pn[1] - target))

    # -- open loop ---------------------------------------------------------------------------------
    def open_loop(self, n: int | None, duration: float | None) -> list[Planned]:
        """Every request with its intended send time, all lanes merged in time order."""
        if self.workload.trace is not None:
            items = self.workload.trace[:n] if n else [t for t in self.workload.trace
                                                         if duration is None or t.t < duration]
            return [self.build(i, t.lane, t.t) for i, t in enumerate(items)]
        counts = self._split(n) if n is not None else {}
        slots = []
        for i, lane in enumerate(self.workload.lanes):
            if n is not None and counts[lane.name] == 0:
                continue
            rng = self._rng(i, 0)
            times = arrivals.offsets(rng, lane.arrival.process, self.lane_rate(lane),
                                     n=counts.get(lane.name) if n is not None else None,
                                     duration=duration if n is None else None, burstiness=lane.arrival.burstiness)
            slots += [(float(t), lane.name) for t in times]
        slots.sort()
        return [self.build(i, name, t) for i, (t, name) in enumerate(slots)]

    def _split(self, n: int) -> dict[str, int]:
        """n requests over lanes by share, largest remainder first (lanes in order on ties)."""
        exact = {k: n * s for k, s in self.shares.items()}
        counts = {k: int(v) for k, v in exact.items()}
        left = n - sum(counts.values())
        for k in sorted(exact, key=lambda k: -(exact[k] - counts[k]))[:left]:
            counts[k] += 1
        return counts

    # -- closed loop --------------------------------------------------------------------------------
    def closed_loop(self) -> Iterator[Planned]:
        """An endless stream of requests, lanes drawn by share; the caller stops it."""
        if self.workload.trace is not None:
            for i, t in enumerate(self.workload.trace):
                yield self.build(i, t.lane, None)
            return
        rng = self._rng(99)
        names, p = list(self.shares), list(self.shares.values())
        i = 0
        while True:
            yield self.build(i, str(rng.choice(names, p=p)), None)
            i += 1
