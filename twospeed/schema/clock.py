"""A request's split clock, its split bill and its speculation trace: the names every layer reads.

The clock holds raw timestamps (seconds, time.monotonic()) stamped by the scheduler and the engine; every derived
number (queue_time, prefill_time, ttft, itl, tpot, ttlt) is computed from them exactly as docs/ARCHITECTURE.md
defines it. The bill counts every token by kind. `clock_json` writes the clock as a response's `twospeed` object
carries it. No torch here: the engine fills them (engine/request.py), the server writes them into each response
(and the planner's simulator into its results), and the lab and the SLO judge (schema/slo.py) read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class Clock:
    """Lifecycle timestamps of one request; derived fields follow the split clock of docs/ARCHITECTURE.md."""

    arrival: float
    first_scheduled: float | None = None
    prefill_done: float | None = None  # the last prompt chunk was computed
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # emission time of every output token
    finished: float | None = None
    decode_steps: int = 0  # steps that computed one of its decode tokens
    interfered_steps: int = 0  # of those, steps that also ran another request's prefill chunk
    longest_interfered_step: float = 0.0  # seconds: the longest of those steps (schedule to sample)
    routed: float | None = None  # behind a router: arrival at the replica (arrival is at the router)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def route_time(self) -> float | None:
        """Behind a router: routed - arrival, the hop to the replica (a part of queue_time); None without one."""
        return None if self.routed is None else self.routed - self.arrival

    @property
    def prefill_time(self) -> float | None:
        if self.prefill_done is None or self.first_scheduled is None:
            return None
        return self.prefill_done - self.first_scheduled

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive output tokens (0 for tokens emitted in the same step)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def ttlt(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        if n < 2 or self.ttlt is None:
            return None
        return (self.ttlt - self.ttft) / (n - 1)

    def summary(self) -> dict[str, float | None]:
        """The derived clock in seconds, with ITL percentiles, for reports and the API."""
        itl = sorted(self.itl)
        return {"queue_time": self.queue_time, "route_time": self.route_time, "prefill_time": self.prefill_time,
                "ttft": self.ttft,
                "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "itl_max": itl[-1] if itl else None,
                "tpot": self.tpot, "ttlt": self.ttlt}


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method) of an already sorted list."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


@dataclass(slots=True)
class Bill:
    """Tokens by kind. Once the prompt is computed, prompt_tokens = cached_tokens + prefilled_tokens."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV first came from the prefix cache (no prefill compute)
    prefilled_tokens: int = 0  # prompt tokens whose KV was first computed by this request
    output_tokens: int = 0  # tokens emitted (paid decode)
    recomputed_tokens: int = 0  # tokens computed again after a preemption dropped their KV
    forced_tokens: int = 0  # of output_tokens, those a grammar forced: appended without a decode step of their own
    spec_proposed: int = 0  # draft tokens computed in verify rows (speculation)
    spec_accepted: int = 0  # of those, kept as output tokens (each one a token its step yielded beyond the first)
    spec_rejected: int = 0  # computed and thrown away: rejected, or past where the request stopped

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "prefilled_tokens": self.prefilled_tokens, "output_tokens": self.output_tokens,
                "recomputed_tokens": self.recomputed_tokens, "forced_tokens": self.forced_tokens,
                "spec_proposed": self.spec_proposed, "spec_accepted": self.spec_accepted,
                "spec_rejected": self.spec_rejected}


MAX_SPEC_EVENTS = 64  # fallback / re-probe / gamma events a trace keeps (later ones are counted, not kept)
# Why a request decodes one token at a time (SpecEvent.cause of "fallback" and "off" events): its own estimate of
# the gain fell below 1, its lane's did, it asked not to speculate, its lane's policy is off.
SPEC_OFF_CAUSES = ("low_gain", "lane_estimate", "opted_out", "lane_policy")


@dataclass(slots=True)
class SpecEvent:
    """A speculation decision for one request: when (its decode step), what and why, with the estimates behind it."""

    step: int  # the request's decode steps so far
    event: str  # "off" (never proposes), "fallback", "reprobe", "resume", "gamma"
    reason: str
    alpha: float | None = None  # running acceptance estimate (per draft position)
    cost_ratio: float | None = None  # c: a verify step's extra time per draft token, as a share of a decode step
    gamma: int = 0  # draft tokens per step after the decision (0: proposing nothing)
    gain: float | None = None  # expected tokens per unit of time against plain decoding: E / (gamma c + 1)
    cause: str | None = None  # for "fallback" and "off": one of SPEC_OFF_CAUSES

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"step": self.step, "event": self.event, "cause": self.cause, "reason": self.reason,
                "alpha": r(self.alpha),
                "cost_ratio": r(self.cost_ratio), "gamma": self.gamma, "gain": r(self.gain)}


@dataclass(slots=True)
class SpecTrace:
    """What speculation did for one request. Every verify step yields 1 + its kept drafts, so output tokens =
    1 (the prefill's sample) + decode steps + accepted (+ grammar-forced tokens) for a request never preempted."""

    method: str = "none"
    verify_steps: int = 0  # decode steps that carried draft tokens
    proposed: int = 0  # draft tokens verified (= bill.spec_proposed)
    accepted: int = 0  # kept (= bill.spec_accepted)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: verify steps that kept draft i + 1
    proposed_per_position: list[int] = field(default_factory=list)  # [i]: verify steps that proposed draft i + 1
    events: list[SpecEvent] = field(default_factory=list)
    events_dropped: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify step yielded on average (1 + accepted drafts), as vLLM reports it."""
        return 1 + self.accepted / self.verify_steps if self.verify_steps else None

    def record(self, proposed: int, kept: int) -> None:
        """A verify step: `proposed` drafts checked, the first `kept` of them kept."""
        self.verify_steps += 1
        self.proposed += proposed
        self.accepted += kept
        for counts, n in ((self.proposed_per_position, proposed), (self.accepted_per_position, kept)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def add_event(self, event: SpecEvent) -> None:
        if len(self.events) < MAX_SPEC_EVENTS:
            self.events.append(event)
        else:
            self.events_dropped += 1

    def as_dict(self) -> dict:
        m = self.mean_acceptance_length
        return {"method": self.method, "verify_steps": self.verify_steps, "proposed": self.proposed,
                "accepted": self.accepted, "rejected": self.proposed - self.accepted,
                "accepted_per_position": list(self.accepted_per_position),
                "proposed_per_position": list(self.proposed_per_position),
                "mean_acceptance_length": None if m is None else round(m, 4),
                "events": [e.as_dict() for e in self.events], "events_dropped": self.events_dropped}


# -- the clock as a response carries it (the `twospeed` object): milliseconds, rounded to the microsecond ------
def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def clock_json(clock: Clock) -> dict:
    s = clock.summary()
    return {"queue_ms": _ms(s["queue_time"]), "route_ms": _ms(s["route_time"]), "prefill_ms": _ms(s["prefill_time"]),
            "ttft_ms": _ms(s["ttft"]),
            "itl_ms": {"p50": _ms(s["itl_p50"]), "p99": _ms(s["itl_p99"]), "max": _ms(s["itl_max"])},
            "tpot_ms": _ms(s["tpot"]), "ttlt_ms": _ms(s["ttlt"]), "decode_steps": clock.decode_steps,
            "interfered_steps": clock.interfered_steps,
            "longest_interfered_step_ms": _ms(clock.longest_interfered_step)}


def merged_clock_json(clocks: list[Clock]) -> dict:
    """The clock of a request with several sequences (n > 1, or a batch of prompts): queue and ttft from the
    first to start, prefill until the last prompt is done, ttlt until the last finishes, itl over all gaps,
    tpot the mean of the sequences'."""
    if len(clocks) == 1:
        return clock_json(clocks[0])
    arrival = min(c.arrival for c in clocks)
    first = [c.first_scheduled for c in clocks if c.first_scheduled is not None]
    done = [c.prefill_done for c in clocks if c.prefill_done is not None]
    first_tok = [c.first_token for c in clocks if c.first_token is not None]
    fin = [c.finished for c in clocks if c.finished is not None]
    gaps = sorted(g for c in clocks for g in c.itl)
    tpots = [c.tpot for c in clocks if c.tpot is not None]
    routed = [c.routed for c in clocks if c.routed is not None]
    return {"queue_ms": _ms(min(first) - arrival) if first else None,
            "route_ms": _ms(min(routed) - arrival) if routed else None,
            "prefill_ms": _ms(max(done) - min(first)) if done and first and len(done) == len(clocks) else None,
            "ttft_ms": _ms(min(first_tok) - arrival) if first_tok else None,
            "itl_ms": {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99)),
                       "max": _ms(gaps[-1]) if gaps else None},
            "tpot_ms": _ms(sum(tpots) / len(tpots)) if tpots else None,
            "ttlt_ms": _ms(max(fin) - arrival) if fin else None,
            "decode_steps": sum(c.decode_steps for c in clocks),
            "interfered_steps": sum(c.interfered_steps for c in clocks),
            "longest_interfered_step_ms": _ms(max(c.longest_interfered_step for c in clocks))}
