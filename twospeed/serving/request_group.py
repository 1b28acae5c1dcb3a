"""Admission and RequestGroup: the sequences of one HTTP request (a choice each: prompt i, sample j), what the
engine needs to admit them, and the StreamItems that arrive for them on the group's asyncio queue, whichever
engine (a thread, a process, a replica) produced them.

`Admission` is the one form a request takes on its way to an engine: the server builds it once, and it crosses
as it is to the engine's thread (AddGroup), to the engine process (the same AddGroup, pickled) and to a cluster
replica (its times moved into Unix seconds, wire.py). `RequestGroup` is the event-loop side around it: the queue
its items arrive on and the deltas added up.

An item carries its sequence's RequestDelta (engine/outputs.py): only what one step changed. The group adds the
deltas up as its reader takes them (`next`), so a streamed choice costs what its delta holds, and a sequence's
last item comes with the whole RequestOutput, built once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from twospeed.engine.outputs import RequestDelta, SequenceOutput
from twospeed.engine.request import RequestOutput
from twospeed.engine.sampling_params import SamplingParams
from twospeed.schema.slo import Verdict


@dataclass(slots=True)
class SequenceSpec:
    """One engine request of an HTTP request (a choice: prompt i, sample j)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int  # the choice index in the response


@dataclass(slots=True)
class StreamItem:
    request_id: str
    index: int  # choice index
    delta: RequestDelta | None  # what the step changed (token times in this process's monotonic clock); None: aborted
    verdict: Verdict | None = None  # set on the sequence's last item
    error: BaseException | None = None  # the engine failed this sequence
    ends_group: bool = False  # the event loop closed the whole group (RequestGroup.close)
    output: RequestOutput | None = None  # the whole output: set by RequestGroup.next on the sequence's last item

    @property
    def finished(self) -> bool:
        return self.delta is None or self.error is not None or self.delta.finished


class EngineError(RuntimeError):
    """The engine failed this sequence (a bug, not the client's input)."""


class ShutdownError(RuntimeError):
    """The server shut down before this request finished."""


class EngineGone(ShutdownError):
    """The engine (its process, every replica) is gone: nothing can be served until it is back (a 503)."""


class StreamBacklog(RuntimeError):
    """The client stopped reading its stream: its undelivered output passed the group's bound, so the request was
    aborted (its KV blocks back, its queue emptied)."""


@dataclass(slots=True)
class Admission:
    """What an engine needs to admit one HTTP request's sequences: all of them or none."""

    lane: str
    priority: int
    arrival_time: float  # monotonic seconds in the process holding it (Unix seconds on a cluster's wire)
    specs: list[SequenceSpec]
    itl_target: float | None = None  # seconds: the lane's tightest ITL objective (LaneSLO.itl_target)
    speculate: bool | None = None  # the lane's speculation policy (LaneSLO.speculate)
    routed_time: float | None = None  # behind a router: arrival at this replica (arrival_time is at the router)


@dataclass(eq=False)
class RequestGroup:
    """An admitted request on the event loop: its Admission and the queue its items arrive on."""

    admission: Admission
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    replica: str | None = None  # behind a router: the replica serving it (the x-twospeed-replica header)
    assemble: bool = True  # add the deltas up (False: a replica passing them on to its ingress as they come)
    seqs: dict[str, SequenceOutput] = field(default_factory=dict)  # request id -> its deltas so far
    # A stream's bound on undelivered output (approximate bytes; None: none) and what to call past it (the
    # engine-side abort): a client that never reads cannot make the server hold its whole output.
    max_backlog: int | None = None
    on_backlog: Callable[[], None] | None = None
    backlog: int = 0  # approximate bytes on the queue
    overflowed: bool = False

    def __post_init__(self) -> None:
        if self.assemble:
            self.seqs = {s.request_id: SequenceOutput(s.request_id, s.prompt_token_ids, s.params.logprobs is not None)
                         for s in self.specs}

    @property
    def lane(self) -> str:
        return self.admission.lane

    @property
    def priority(self) -> int:
        return self.admission.priority

    @property
    def arrival_time(self) -> float:
        return self.admission.arrival_time

    @property
    def specs(self) -> list[SequenceSpec]:
        return self.admission.specs

    @property
    def routed_time(self) -> float | None:
        return self.admission.routed_time

    def admit(self) -> Admission:
        """The admission to send, the group now waiting on every one of its sequences."""
        self.unfinished = {s.request_id for s in self.specs}
        return self.admission

    async def next(self) -> StreamItem:
        item = await self.queue.get()
        if self.max_backlog is not None:
            self.backlog -= item_bytes(item)
        return self.take(item)

    def put(self, item: StreamItem) -> None:
        """An item for the reader (on the event loop). Past max_backlog the queue is emptied, the reader gets one
        StreamBacklog error that ends the group, on_backlog aborts the engine side, and later items are dropped."""
        if self.overflowed:
            return
        self.queue.put_nowait(item)
        if self.max_backlog is None:
            return
        self.backlog += item_bytes(item)
        if self.backlog > self.max_backlog:
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.backlog = 0
            self.queue.put_nowait(StreamItem("", -1, None, ends_group=True, error=StreamBacklog(
                f"the client stopped reading: over {self.max_backlog:,} bytes of output were waiting, so the "
                "request was aborted")))
            if self.on_backlog is not None:
                self.on_backlog()

    def take(self, item: StreamItem) -> StreamItem:
        """Account for an item read off the queue: the sequence it ends, the delta it adds (and on a sequence's
        last item, its whole output)."""
        if item.ends_group:
            self.unfinished.clear()
        elif item.finished:
            self.unfinished.discard(item.request_id)
        seq = self.seqs.get(item.request_id)
        if seq is not None and item.delta is not None:
            seq.add(item.delta)
            if item.delta.finished:
                item.output = seq.output()
        return item

    def close(self, error: BaseException) -> None:
        """End the group from the event loop now (shutdown): its reader's next item carries `error`. The engine
        side is aborted separately (AsyncEngine.abort)."""
        self.queue.put_nowait(StreamItem("", -1, None, error=error, ends_group=True))

    @property
    def done(self) -> bool:
        return not self.unfinished


def item_bytes(item: StreamItem) -> int:
    """About what an item costs to hold and to send as an SSE chunk: its tokens, text and logprobs."""
    delta = item.delta
    if delta is None:
        return 64
    size = 200 + 16 * len(delta.new_token_ids) + 2 * len(delta.new_text)
    prompt = delta.finish.prompt_logprobs if delta.finish is not None else None
    for lp in [*(delta.new_logprobs or ()), *(prompt or ())]:
        size += 64 + 48 * len(lp.top) if lp is not None else 8
    return size


def resolve_future(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    """Settle a future another thread answered (run on its event loop); a cancelled one stays as it is."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def deliver_items(batch: list[tuple[RequestGroup, StreamItem]]) -> None:
    """Put each item on its group's queue (on the event loop: an engine's thread hands it over with
    call_soon_threadsafe)."""
    for group, item in batch:
        group.put(item)

