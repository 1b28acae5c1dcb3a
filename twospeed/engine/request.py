"""A request's state as the engine keeps it, and the output it hands back.

Its split clock, split bill and speculation trace are the shared vocabulary's (schema/clock.py): the scheduler
and the engine stamp and count into them here, and every layer above reads them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from twospeed.engine.sampling_params import SamplingParams
from twospeed.schema.clock import (  # noqa: F401  (the clock's and bill's names, as the engine's modules import them)
    MAX_SPEC_EVENTS, SPEC_OFF_CAUSES, Bill, Clock, SpecEvent, SpecTrace, percentile)


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
