"""The run plan: which request of which lane goes out when, with which prompt.

Each lane's arrivals are drawn from its own process at its share of the rate; each request's prompt is drawn
from a generator seeded by (seed, lane, index), so a request's bytes do not depend on the order in which the
plan is built (closed-loop runs build prompts lazily). `--scale` multiplies every prompt length and
`max_prompt_tokens` caps each prompt (measured with the tokenizer when there is one), so every workload fits
a small-context model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from twospeed.lab import arrivals, prompts
from twospeed.lab.workload import Lane, Workload


@dataclass(slots=True)
class PlanConfig:
    seed: int = 0
    salt: str = ""  # first line of every prompt: a fresh one defeats caches left by earlier runs
    scale: float = 1.0  # multiplies prompt lengths (prefix and new part)
    max_prompt_tokens: int | None = None  # cap per prompt (tokens of --tokenizer, else estimated)
    rate: float | None = None  # total requests/s, split over lanes by share; None = the lanes' own rates
    max_output_tokens: int | None = None  # cap on every request's max_tokens (shorter runs)

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 32:
            raise ValueError(f"--max-prompt-tokens must be >= 32, got {self.max_prompt_tokens}")


@dataclass(slots=True)
class Planned:
    index: int
    lane: str
    offset: float | None  # intended send time (s from start); None in closed loop
    prompt: str
    max_tokens: int
    meta: dict = field(default_factory=dict)


class Planner:
    """Builds prompts for a workload under a PlanConfig; holds each lane's shared prefix."""

    def __init__(self, workload: Workload, config: PlanConfig, counter: prompts.TokenCounter):
        self.workload, self.config, self.counter = workload, config, counter
        total = sum(lane.share for lane in workload.lanes)
        self.shares = {lane.name: lane.share / total for lane in workload.lanes}
        self.prefixes = {lane.name: self._prefix(lane, i, None) for i, lane in enumerate(workload.lanes)}
        self.turns: dict[str, int] = {}

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, *key])

    def _prefix(self, lane: Lane, lane_idx: int, request: int | None) -> str:
        key = (lane_idx, 1) if request is None else (lane_idx, 2, request)
        tokens = round(lane.prefix_tokens * self.config.scale)
        salt = f"[run {self.config.salt}]\n" if self.config.salt else ""
        return salt + prompts.shared_prefix(lane.kind, self._rng(*key), self.counter, tokens)

    def lane_rate(self, lane: Lane) -> float:
        return self.config.rate * self.shares[lane.name] if self.config.rate else lane.arrival.rate

    def build(self, index: int, lane_name: str, offset: float | None) -> Planned:
        """Request `index` of `lane_name`: deterministic in (seed, lane, index)."""
        if self.workload.trace is not None:
            item = self.workload.trace[index]
            return Planned(index, item.lane, offset, item.prompt, item.max_tokens)
        lane_idx = next(i for i, lane in enumerate(self.workload.lanes) if lane.name == lane_name)
        lane = self.workload.lanes[lane_idx]
        rng = self._rng(lane_idx, 3, index)
        prefix = self.prefixes[lane.name] if rng.random() < lane.prefix_reuse else self._prefix(lane, lane_idx, index)
        new = max(1, round(lane.prompt_tokens.sample(rng) * self.config.scale))
        max_tokens = lane.max_tokens.sample(rng)
        if self.config.max_output_tokens:
            max_tokens = min(max_tokens, self.config.max_output_tokens)
        turn = self.turns[lane.name] = self.turns.get(lane.name, 0) + 1
        state = rng.bit_generator.state
        for _ in range(6):  # shrink the new part until the prompt fits the cap
            rng.bit_generator.state = state
            p = prompts.BUILDERS[lane.kind](rng, self.counter, prefix, new, turn)
            cap = self.config.max_prompt_tokens
            if cap is None:
                break
            n = self.counter.count(p.text)
            if n <= cap:
                break
            if new <= 1:
                raise ValueError(f"lane {lane.name!r}: the shared prefix alone is over --max-prompt-tokens {cap}; "
                                 f"lower --scale")
            new = max(1, new - (n - cap) - 8)
        else:
            raise ValueError(f"lane {lane.name!r}: could not fit a prompt under --max-prompt-tokens {cap}")
        return Planned(index, lane.name, offset, p.text, max_tokens, p.meta)

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
