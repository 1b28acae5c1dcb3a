"""RequestGroup: the sequences of one HTTP request (a choice each: prompt i, sample j), and the StreamItems that
arrive for them on the group's asyncio queue, whichever engine (a thread, a process, a replica) produced them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from twospeed.engine.request import RequestOutput
from twospeed.engine.sampling_params import SamplingParams
from twospeed.server.slo import Verdict


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
    output: RequestOutput | None  # None when the sequence was aborted
    token_times: list[float]  # monotonic emission time of each of output.new_token_ids
    verdict: Verdict | None = None  # set on the sequence's last item
    error: BaseException | None = None  # the engine failed this sequence
    ends_group: bool = False  # the event loop closed the whole group (RequestGroup.close)

    @property
    def finished(self) -> bool:
        return self.output is None or self.error is not None or self.output.finished


class EngineError(RuntimeError):
    """The engine failed this sequence (a bug, not the client's input)."""


class ShutdownError(RuntimeError):
    """The server shut down before this request finished."""


@dataclass(eq=False)
class RequestGroup:
    """The sequences of one HTTP request and the queue their items arrive on (event-loop side)."""

    lane: str
    priority: int
    arrival_time: float
    specs: list[SequenceSpec]
    itl_target: float | None = None  # seconds: the lane's tightest ITL objective (LaneSLO.itl_target)
    speculate: bool | None = None  # the lane's speculation policy (LaneSLO.speculate)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    routed_time: float | None = None  # behind a router: arrival at this replica (arrival_time is at the router)
    replica: str | None = None  # behind a router: the replica serving it (the x-twospeed-replica header)

    async def next(self) -> StreamItem:
        item = await self.queue.get()
        if item.ends_group:
            self.unfinished.clear()
        elif item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def close(self, error: BaseException) -> None:
        """End the group from the event loop now (shutdown): its reader's next item carries `error`. The engine
        side is aborted separately (AsyncEngine.abort)."""
        self.queue.put_nowait(StreamItem("", -1, None, [], error=error, ends_group=True))

    @property
    def done(self) -> bool:
        return not self.unfinished


def deliver_items(batch: list[tuple[RequestGroup, StreamItem]]) -> None:
    """Put each item on its group's queue (on the event loop: an engine's thread hands it over with
    call_soon_threadsafe)."""
    for group, item in batch:
        group.queue.put_nowait(item)

