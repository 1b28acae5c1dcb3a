"""When to speculate and how far: per request and per lane, from the acceptance and the cost each one measures.

A verify step costs more than a plain decode step (a logits row and attention rows per draft token, and the
proposer's own time) and yields 1 + the drafts kept. With a per-position acceptance alpha, gamma drafts yield
E(alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha) tokens a step on average; with c the step's extra time per
draft token as a share of the plain step, the step takes (gamma c + 1) plain steps, so speculating pays where

    gain = E(alpha, gamma) / (gamma c + 1) > 1.

Both come from what the engine measured: alpha from the request's own verify steps (kept drafts over draft
positions tried: the kept ones plus the first rejected), c from the step cost model (engine/cost_model.py, fitted
to this engine's own step times), which prices every verify step's shape and its plain twin (the same step with no
draft rows), plus the proposer's measured seconds: c = (T_step + T_propose - T_plain) / (gamma T_plain), so that
gain is the request's own tokens per second against plain decoding (its drafts and its batch mates' slow the step
it rides in alike). Estimates are exponentially weighted (a request's over its last few verify steps, a lane's over
many more).

Per request: it starts with gamma = num_speculative_tokens (or what its lane's estimate chooses); after
MIN_EVIDENCE verify steps its own estimate picks the gamma of the highest gain each step; where even the best gain
is below 1 it falls back to one token at a time and re-probes after `reprobe_steps` of its decode steps (twice as
long after each repeated fallback, at most 8x), with a fresh estimate. Per lane: a request starts off where its
lane's estimate says the draft does not pay, and re-probes on the same schedule, so a lane whose traffic stops
accepting (open text) turns itself off while a templated lane keeps speculating. Every decision is a SpecEvent in
the request's trace, with the estimates behind it. No torch here (the planner can run it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twospeed.config import SpecConfig
from twospeed.engine.request import Request, SpecEvent

MIN_EVIDENCE = 3  # verify steps of a request's own before its estimate decides
REQUEST_DECAY = 0.8  # weight kept per observation: a request follows its last ~5 verify steps
LANE_DECAY = 0.95  # a lane its last ~20
MAX_BACKOFF = 8  # re-probe waits at most this many times reprobe_steps


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a verify step of gamma drafts yields on average when each is kept with probability alpha (until the
    first rejection): 1 + alpha + ... + alpha^gamma."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_gain(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Tokens per unit time against plain decoding: E(alpha, gamma) / (gamma c + 1)."""
    return expected_tokens(alpha, gamma) / (gamma * cost_ratio + 1.0)


@dataclass(slots=True)
class Estimate:
    """Exponentially weighted acceptance and cost ratio over verify steps."""

    kept: float = 0.0  # weighted drafts kept
    tried: float = 0.0  # weighted draft positions tried: kept, plus the first rejected where one was
    cost: float = 0.0  # weighted sum of c
    weight: float = 0.0  # weighted count of observations
    count: int = 0  # observations

    def observe(self, proposed: int, accepted: int, cost_ratio: float, decay: float) -> None:
        self.kept = decay * self.kept + accepted
        self.tried = decay * self.tried + accepted + (accepted < proposed)
        self.cost = decay * self.cost + cost_ratio
        self.weight = decay * self.weight + 1.0
        self.count += 1

    @property
    def alpha(self) -> float | None:
        return self.kept / self.tried if self.tried else None

    @property
    def cost_ratio(self) -> float:
        return self.cost / self.weight if self.weight else 0.0

    def best(self, max_gamma: int) -> tuple[int, float]:
        """(gamma, gain) of the highest expected gain, gamma in 1..max_gamma."""
        alpha, c = self.alpha or 0.0, self.cost_ratio
        return max(((g, expected_gain(alpha, g, c)) for g in range(1, max_gamma + 1)), key=lambda x: x[1])


@dataclass(slots=True)
class SpecState:
    """One request's speculation: how many drafts it asks for now and why."""

    gamma: int  # draft tokens to propose this step (0: decoding one token at a time)
    mode: str = "on"  # on | probe (re-probing after a fallback) | off (fallen back) | never (opted out)
    estimate: Estimate = field(default_factory=Estimate)
    off_until: int = 0  # its decode step at which an "off" request probes again
    backoff: int = 0  # decode steps the next fallback waits
    waited: int = 0  # decode steps the last fallback waited


class SpecPolicy:
    """The per-request and per-lane decisions; the engine calls start, gamma and observe."""

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.lanes: dict[str, Estimate] = {}

    def lane_estimate(self, lane: str) -> Estimate:
        return self.lanes.setdefault(lane, Estimate())

    def start(self, req: Request, off: str | None = None) -> None:
        """A new request: speculate (with gamma from its lane's estimate once the lane has one), start off where
        the lane's estimate says it does not pay, or never (off: "opted_out" or "lane_policy")."""
        cfg = self.cfg
        req.spec.method = cfg.method
        state = req.spec_state = SpecState(cfg.num_speculative_tokens, backoff=cfg.reprobe_steps)
        if off is not None:
            state.mode, state.gamma = "never", 0
            why = {"opted_out": "the request asked not to speculate (speculate: false)",
                   "lane_policy": f"lane {req.lane!r}: its policy is speculate=off"}[off]
            req.spec.add_event(SpecEvent(0, "off", why, cause=off))
            return
        lane = self.lanes.get(req.lane)
        if not cfg.auto_fallback or lane is None or lane.count < MIN_EVIDENCE:
            return
        gamma, gain = lane.best(cfg.num_speculative_tokens)
        if gain < 1.0:
            self._fall_back(req, f"lane {req.lane!r}: expected gain below 1", lane, gain, "lane_estimate")
        else:
            state.gamma = gamma

    def gamma(self, req: Request) -> int:
        """Draft tokens req should get this step (0: none); an "off" request whose wait is over starts a probe."""
        state = req.spec_state
        if state is None or state.mode == "never":
            return 0
        if state.mode == "off":
            if req.clock.decode_steps < state.off_until:
                return 0
            state.mode, state.gamma, state.estimate = "probe", self.cfg.num_speculative_tokens, Estimate()
            req.spec.add_event(SpecEvent(req.clock.decode_steps, "reprobe",
                                         f"{state.waited} decode steps after falling back", gamma=state.gamma))
        return state.gamma

    def observe(self, req: Request, proposed: int, accepted: int, cost_ratio: float) -> None:
        """A verify step of req: `proposed` drafts, the first `accepted` kept by the sampler; c as measured."""
        state = req.spec_state
        if state is None or proposed <= 0:
            return
        state.estimate.observe(proposed, accepted, cost_ratio, REQUEST_DECAY)
        self.lane_estimate(req.lane).observe(proposed, accepted, cost_ratio, LANE_DECAY)
        if not self.cfg.auto_fallback or state.estimate.count < MIN_EVIDENCE:
            return
        gamma, gain = state.estimate.best(self.cfg.num_speculative_tokens)
        if gain < 1.0:
            self._fall_back(req, "expected gain below 1", state.estimate, gain, "low_gain")
            return
        if state.mode == "probe":
            state.mode, state.backoff = "on", self.cfg.reprobe_steps
            self._event(req, "resume", "the probe's expected gain is above 1", state.estimate, gamma, gain)
        if gamma != state.gamma:
            self._event(req, "gamma", f"{state.gamma} -> {gamma} drafts: the highest expected gain", state.estimate,
                        gamma, gain)
        state.gamma = gamma

    def _fall_back(self, req: Request, reason: str, estimate: Estimate, gain: float, cause: str) -> None:
        state = req.spec_state
        state.mode, state.gamma = "off", 0
        state.off_until = req.clock.decode_steps + state.backoff
        state.waited = state.backoff
        self._event(req, "fallback", f"{reason}; re-probe in {state.backoff} decode steps", estimate, 0, gain, cause)
        state.backoff = min(2 * state.backoff, MAX_BACKOFF * self.cfg.reprobe_steps)

    @staticmethod
    def _event(req: Request, event: str, reason: str, estimate: Estimate, gamma: int, gain: float,
               cause: str | None = None) -> None:
        req.spec.add_event(SpecEvent(req.clock.decode_steps, event, reason, estimate.alpha, estimate.cost_ratio,
                                     gamma, gain, cause))


STEP_DECAY = 0.8  # measured step times: a shape follows its last ~5 steps


@dataclass(slots=True)
class MeasuredSteps:
    """The engine's measured times of steps that only decode: plain ones by decode rows, verify ones by (decode
    rows, draft tokens). The cost ratio c of speculation comes from these where both sides have been seen: the
    linear cost model cannot price the jump where a few more rows move a CPU step from the C linear kernel to
    oneDNN (AMX), and a ratio it under-predicts keeps a draft that does not pay."""

    plain: dict[int, float] = field(default_factory=dict)
    verify: dict[tuple[int, int], float] = field(default_factory=dict)

    def observe(self, prefill_tokens: int, decode_tokens: int, draft_tokens: int, seconds: float) -> None:
        if prefill_tokens or decode_tokens <= 0:
            return  # a prompt chunk's cost says nothing about the decode rows beside it
        table, key = (self.verify, (decode_tokens, draft_tokens)) if draft_tokens else (self.plain, decode_tokens)
        old = table.get(key)
        table[key] = seconds if old is None else STEP_DECAY * old + (1 - STEP_DECAY) * seconds

    def times(self, decode_tokens: int, draft_tokens: int) -> tuple[float, float] | None:
        """(verify step seconds, plain step seconds) of this shape, if both were measured."""
        verify, plain = self.verify.get((decode_tokens, draft_tokens)), self.plain.get(decode_tokens)
        return None if verify is None or plain is None or plain <= 0 else (verify, plain)

