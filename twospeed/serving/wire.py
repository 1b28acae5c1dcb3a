"""What crosses between a cluster's ingress and a replica, and the clock's time base on each side.

The ingress sends the request's Admission (request_group.py: the prepared sequences, the lane, the arrival), its
arrival in Unix seconds (`admission_to_wire`); the replica answers with a
stream of messages: first Admitted (or Refused, the engine's ValueError with its field), then Batches of the
StreamItems its engine produced, each batch with the load it is under. An item carries its sequence's
RequestDelta (engine/outputs.py): only what is new, and at the end the clock, the bill and speculation's trace
once; the ingress's RequestGroup adds the deltas up as the local engine's.

Times cross as Unix seconds: each side converts from and to its own time.monotonic() (the replica may be on
another machine, whose monotonic clock has another origin). The arrival is the ingress's; the replica stamps
`routed` when the request reaches it, so route_time = routed - arrival is the hop, measured with the two
machines' wall clocks (exact on one machine; across machines, up to their NTP offset, clamped at 0).

No Ray and no torch here.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from twospeed.engine.outputs import RequestDelta
from twospeed.engine.request import Clock
from twospeed.serving.request_group import Admission, StreamItem

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
class Admitted:
    route_time: float  # seconds from the ingress's arrival to the replica's
    load: Load


@dataclass(slots=True)
class Refused:
    """The replica's engine refused the group (a ValueError: 400, its field in `param`)."""

    message: str
    param: str | None = None


@dataclass(slots=True)
class Batch:
    items: list[StreamItem]  # times in Unix seconds (to_wire)
    load: Load


def admission_to_wire(admission: Admission, base: TimeBase) -> Admission:
    """Ingress side: the admission as it crosses, its arrival in Unix seconds (a copy)."""
    return dataclasses.replace(admission, arrival_time=base.to_unix(admission.arrival_time), routed_time=None)


def admission_from_wire(admission: Admission, base: TimeBase, now: float) -> tuple[Admission, float]:
    """Replica side: the admission in this process's monotonic seconds, stamped routed at `now` (a monotonic
    reading), and the hop's time (clamped at 0: across machines the wall clocks may disagree)."""
    route_time = max(0.0, base.to_unix(now) - admission.arrival_time)
    admission.arrival_time, admission.routed_time = now - route_time, now
    return admission, route_time


def to_wire(item: StreamItem, base: TimeBase) -> StreamItem:
    """Replica side: the item as it crosses, its times in Unix seconds (the delta's emission times, and the clock
    with the last delta). A copy: the replica's own objects are left as they are."""
    delta = item.delta
    if delta is None:
        return dataclasses.replace(item, output=None)
    return dataclasses.replace(item, delta=_shift_delta(delta, base.offset), output=None)


def from_wire(item: StreamItem, base: TimeBase) -> StreamItem:
    """Ingress side: an item off the wire, its times in this process's monotonic seconds."""
    if item.delta is not None:
        item.delta = _shift_delta(item.delta, -base.offset)
    return item


def _shift_delta(delta: RequestDelta, by: float) -> RequestDelta:
    finish = delta.finish
    if finish is not None:
        finish = dataclasses.replace(finish, clock=shift_clock(finish.clock, by))
    return dataclasses.replace(delta, token_times=[t + by for t in delta.token_times], finish=finish)
