"""A request's state, its split clock and its split bill.

The clock holds raw timestamps (seconds, time.monotonic()) stamped by the
scheduler and the engine; every derived number (queue_time, prefill_time, ttft,
itl, tpot, ttlt) is computed from them exactly as docs/ARCHITECTURE.md defines it. The
bill counts every token by kind.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from twospeed.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV dropped; it will recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed this request alone (Request.error says how); the rest went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


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


@dataclass(slots=True)
class Logprob:
    """The sampled token's log-probability under the model, its rank and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: dict[int, float]  # token id -> logprob, the n most likely


class Request:
    """Everything the scheduler and engine track for one request.

    The one accounting rule: `num_computed_tokens` of `num_tokens` (prompt +
    output so far) have KV in the cache; each step computes some of the rest.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                 eos_token_ids: frozenset[int] = frozenset(), max_output_tokens: int, lane: str = "default"):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.lane = lane  # the server's lane name: speculation keeps its acceptance estimates per lane
        # Seconds: the tightest ITL objective of the request's lane (the server sets it from --slo); None = the
        # scheduler's default step target; math.inf = its lane has objectives, none of them on ITL.
        self.itl_target: float | None = None
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None  # why the engine failed it (status FINISHED_ERROR)
        self.clock = Clock(arrival=time.monotonic() if arrival_time is None else arrival_time)
        self.bill = Bill(prompt_tokens=len(prompt_token_ids))
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.max_output_tokens = max_output_tokens  # params.max_tokens clipped to max_model_len
        self.logprobs: list[Logprob] = []
        # params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it); filled as the
        # prompt's chunks run (engine/runner.py's prompt rows)
        self.prompt_logprobs: list[Logprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.num_preemptions = 0
        self.high_water = 0  # positions [0, high_water) were computed or served from cache at least once
        self.generator = None  # torch.Generator when params.seed is set (made by the sampler)
        self.grammar = None  # structured.GrammarState when params.structured is set
        self.detokenizer = None  # IncrementalDetokenizer when a tokenizer is loaded
        self.text = ""
        self.num_emitted = 0  # output tokens already reported (RequestOutput.new_token_ids, RequestDelta)
        self.num_logprobs_emitted = 0  # of self.logprobs, those already in a RequestDelta
        # Speculation: draft tokens for this step's verify rows, held beside the accepted tokens (never in
        # all_token_ids, never hashed into the prefix cache) until the sampler has checked them.
        self.spec_token_ids: list[int] = []
        # The prefix-cache hash of each full block of all_token_ids found so far (KVCacheManager.find_cached_prefix
        # extends it): a full block's tokens never change, so a request waiting for several steps hashes them once.
        self.block_hashes: list[bytes] = []
        self.spec = SpecTrace()
        self.spec_state = None  # spec_policy.SpecState while speculation is enabled for it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus this step's draft tokens: what a verify chunk computes up to."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int, now: float) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.bill.output_tokens += 1
        if self.clock.first_token is None:
            self.clock.first_token = now
        self.clock.token_times.append(now)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, prompt={self.num_prompt_tokens})")


@dataclass(slots=True)
class RequestOutput:
    """What one request produced so far. For streaming, new_token_ids / new_text hold this step's delta."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[Logprob] | None
    clock: Clock
    bill: Bill
    num_preemptions: int = 0
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    spec: SpecTrace | None = None  # the acceptance trace (None when the engine does not speculate)
    prompt_logprobs: list[Logprob | None] | None = None  # when asked: per prompt token, None for the first
