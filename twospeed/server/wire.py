"""What crosses a process boundary between the HTTP side and an engine (a cluster's ingress and a replica; the
server and its engine process), and the clock's time base on each side.

The ingress sends a RoutedGroup (the prepared sequences, the lane, the arrival); the replica answers with a
stream of messages: first Admitted (or Refused, the engine's ValueError with its field), then Batches of Deltas
(the StreamItems its AsyncEngine produced, each with the load it is under). A Delta carries only what is new:
the step's token ids, text, emission times and logprobs, and at the end the clock, the bill, the SLO verdict and
speculation's trace (each whole once, not per token). The ingress's Assembler turns Deltas back into the StreamItems
the routes read, with whole RequestOutputs as the local engine gives them.

Times cross as Unix seconds: each side converts from and to its own time.monotonic() (the replica may be on
another machine, whose monotonic clock has another origin). The arrival is the ingress's; the replica stamps
`routed` when the request reaches it, so route_time = routed - arrival is the hop, measured with the two
machines' wall clocks (exact on one machine; across machines, up to their NTP offset, clamped at 0).

No Ray and no torch here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from twospeed.engine.request import Bill, Clock, Logprob, RequestOutput, SpecTrace
from twospeed.server.request_group import EngineError, SequenceSpec, ShutdownError, StreamItem
from twospeed.server.slo import Verdict

STAMPS = ("arrival", "first_scheduled", "prefill_done", "first_token", "finished", "routed")  # Clock's time fields


class TimeBase:
    """This process's time.monotonic() <-> Unix seconds (offset fixed at creation)."""

    def __init__(self, offset: float | None = None) -> None:
        """offset 0: the "Unix" seconds are monotonic ones (two processes on one host share that clock)."""
        self.offset = time.time() - time.monotonic() if offset is None else offset

    def to_unix(self, t: float) -> float:
        return t + self.offset

    def from_unix(self, t: float) -> float:
        return t - self.offset


def shift_clock(clock: Clock, by: float) -> Clock:
    """A copy of the clock with every stamp moved by `by` seconds (into another time base)."""
    moved = {name: getattr(clock, name) + by for name in STAMPS if getattr(clock, name) is not None}
    return dataclasses.replace(clock, token_times=[t + by for t in clock.token_times], **moved)


@dataclass(slots=True)
class Load:
    """A replica's load when it sent a message."""

    waiting: int = 0  # sequences waiting to be scheduled
    running: int = 0  # sequences in its running batch
    kv_usage: float = 0.0  # share of its KV blocks in use
    cached_blocks: int = 0  # blocks holding a cached prefix


@dataclass(slots=True)
class RoutedGroup:
    """A request on its way to a replica: its sequences as the ingress prepared them."""

    lane: str
    priority: int
    arrival_unix: float  # arrival at the ingress
    specs: list[SequenceSpec]
    itl_target: float | None = None  # seconds: the lane's tightest ITL objective (the scheduler sizes steps to it)
    speculate: bool | None = None  # the lane's speculation policy (False: the lane does not speculate)


@dataclass(slots=True)
class Admitted:
    route_time: float  # seconds from the ingress's arrival to the replica's
    load: Load


@dataclass(slots=True)
class Refused:
    """The replica's engine refused the group (a ValueError: 400, its field in `param`)."""

    message: str
    param: str | None = None


@dataclass(slots=True)
class Delta:
    """One StreamItem, as little of it as the other side cannot work out."""

    request_id: str
    index: int
    aborted: bool = False  # ended with no output (an abort)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    text: str | None = None  # the whole text so far, only when it is not the last text + new_text
    token_times: list[float] = field(default_factory=list)  # Unix s
    new_logprobs: list[Logprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None
    shutdown: bool = False  # the error is the replica shutting down (503), not an engine failure (500)
    ends_group: bool = False  # the replica closed the whole group (its shutdown)
    clock: Clock | None = None  # at the end: the whole clock, stamps in Unix s
    bill: Bill | None = None  # at the end
    spec: SpecTrace | None = None  # at the end: speculation's acceptance trace (None: the replica does not speculate)
    verdict: Verdict | None = None  # at the end


@dataclass(slots=True)
class Batch:
    deltas: list[Delta]
    load: Load


class Encoder:
    """Replica side: a group's StreamItems -> Deltas (remembers what each sequence has sent)."""

    def __init__(self, base: TimeBase):
        self.base = base
        self._text: dict[str, str] = {}
        self._logprobs: dict[str, int] = {}

    def delta(self, item: StreamItem) -> Delta:
        to_unix, out = self.base.to_unix, item.output
        d = Delta(item.request_id, item.index, error=None if item.error is None else str(item.error),
                  shutdown=isinstance(item.error, ShutdownError), ends_group=item.ends_group)
        if out is None:
            d.aborted = True
            return d
        rid = out.request_id
        before = self._text.get(rid, "")
        d.new_token_ids, d.new_text = list(out.new_token_ids), out.new_text
        d.text = None if out.text == before + out.new_text else out.text
        self._text[rid] = out.text
        d.token_times = [to_unix(t) for t in item.token_times]
        if out.logprobs is not None:
            sent = self._logprobs.get(rid, 0)
            d.new_logprobs, self._logprobs[rid] = out.logprobs[sent:], len(out.logprobs)
        d.finished, d.finish_reason, d.stop_reason = out.finished, out.finish_reason, out.stop_reason
        d.num_preemptions = out.num_preemptions
        if out.finished:
            d.clock, d.bill, d.verdict = shift_clock(out.clock, self.base.offset), out.bill, item.verdict
            d.spec = out.spec
            self._text.pop(rid, None)
            self._logprobs.pop(rid, None)
        return d


class _Sequence:
    """The ingress's copy of one sequence: what its Deltas added up to."""

    def __init__(self, spec: SequenceSpec, arrival: float):
        self.spec = spec
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[Logprob] | None = [] if spec.params.logprobs is not None else None
        self.clock = Clock(arrival=arrival)  # until the replica's whole clock arrives with the last delta
        self.bill = Bill(prompt_tokens=len(spec.prompt_token_ids))
        self.trace: SpecTrace | None = None  # speculation's trace from the replica, with the last delta


class Assembler:
    """Ingress side: Deltas -> the StreamItems (with whole RequestOutputs) the routes read."""

    def __init__(self, specs: list[SequenceSpec], arrival: float, base: TimeBase):
        self.base = base
        self._seqs = {s.request_id: _Sequence(s, arrival) for s in specs}

    def item(self, d: Delta) -> StreamItem:
        error = None
        if d.error is not None:
            error = (ShutdownError if d.shutdown else EngineError)(d.error)
        if d.aborted:
            return StreamItem(d.request_id, d.index, None, [], error=error, ends_group=d.ends_group)
        seq, from_unix = self._seqs[d.request_id], self.base.from_unix
        times = [from_unix(t) for t in d.token_times]
        seq.token_ids += d.new_token_ids
        seq.text = d.text if d.text is not None else seq.text + d.new_text
        if seq.logprobs is not None and d.new_logprobs:
            seq.logprobs += d.new_logprobs
        if d.clock is not None:
            seq.clock = shift_clock(d.clock, -self.base.offset)
            seq.bill, seq.trace = d.bill, d.spec
        else:
            if times and seq.clock.first_token is None:
                seq.clock.first_token = times[0]
            seq.clock.token_times += times
        out = RequestOutput(
            request_id=d.request_id, prompt=None, prompt_token_ids=seq.spec.prompt_token_ids,
            token_ids=list(seq.token_ids), text=seq.text, new_token_ids=d.new_token_ids, new_text=d.new_text,
            finished=d.finished, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None, clock=seq.clock, bill=seq.bill,
            num_preemptions=d.num_preemptions, error=d.error if not d.shutdown else None, spec=seq.trace)
        return StreamItem(d.request_id, d.index, out, times, d.verdict, error)

    def output_tokens(self, request_id: str) -> list[int]:
        """The sequence's prompt and output so far (what the replica's cache now holds)."""
        seq = self._seqs[request_id]
        return [*seq.spec.prompt_token_ids, *seq.token_ids]
