"""What the engine thread tells its listeners: a step ran, the load changed, a sequence ended, a step failed.

AsyncEngine holds a list of listeners (plain callables taking one event) and calls each, in the engine thread,
with these plain objects; the Prometheus metrics and the dashboard's history are two such listeners. A
listener must be quick (it runs between steps) and must not keep the Request beyond the call: the engine owns
it. One that raises is logged and the others still run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from twospeed.engine.engine_stats import StepStats
from twospeed.engine.request import Bill, Clock, Request, SpecTrace
from twospeed.schema.slo import Verdict

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepEvent:
    """One engine step ran (StepStats says what it did)."""

    stats: StepStats


@dataclass(slots=True)
class LoadEvent:
    """The engine's load when a step or a command changed it: sequences per lane and the KV pool's state."""

    running: dict[str, int]  # lane -> sequences in the running batch
    waiting: dict[str, int]  # lane -> sequences waiting (new or preempted)
    kv_usage: float  # KV blocks in use / blocks in the pool
    cached_blocks: int  # blocks holding a cached prefix (in use or free and reusable)


@dataclass(slots=True)
class EndedSequence:
    """What a listener or the judge reads of an ended Request, for one that ended in another process (the engine
    process sends this, not the Request)."""

    request_id: str
    clock: Clock
    bill: Bill
    num_preemptions: int
    finish_reason: str | None
    spec: SpecTrace | None  # speculation's acceptance trace (None: the engine does not speculate)

    @classmethod
    def of(cls, request: Request) -> "EndedSequence":
        return cls(request.request_id, request.clock, request.bill, request.num_preemptions, request.finish_reason,
                   request.spec)


@dataclass(slots=True)
class FinishEvent:
    """A sequence ended: finished by the engine (stop, length, error) or aborted (client gone, shutdown)."""

    lane: str
    request: Request | EndedSequence  # read it during the call only
    aborted: bool
    verdict: Verdict | None  # the lane's SLO verdict; None when aborted

    def counts(self) -> dict[str, int]:
        """What the sequence adds to the lane's counters: its bill by kind (prompt tokens only once it was
        scheduled: the bill is set then), prefix-cache lookups and hits, preemptions, and goodput (output tokens
        of a sequence that met its SLO). The metrics and the dashboard's totals both add exactly these."""
        bill, req = self.request.bill.as_dict(), self.request
        if req.clock.first_scheduled is None:
            bill.update(prompt_tokens=0, cached_tokens=0, prefilled_tokens=0)
        good = self.verdict is not None and self.verdict.met
        return {**bill, "prefix_queries": bill["prompt_tokens"], "prefix_hits": bill["cached_tokens"],
                "preemptions": req.num_preemptions, "goodput_tokens": bill["output_tokens"] if good else 0}


@dataclass(slots=True)
class FaultEvent:
    """A step raised: scope "request" (isolated to the request(s) that caused it) or "step" (all in flight failed)."""

    scope: str


EngineEvent = StepEvent | LoadEvent | FinishEvent | FaultEvent
Listener = Callable[[EngineEvent], None]


def tell(listeners: list[Listener], event: EngineEvent) -> None:
    """Tell every listener; one that raises is logged and the rest still hear it."""
    for listener in listeners:
        try:
            listener(event)
        except Exception:
            log.exception("listener %r failed on %s", listener, type(event).__name__)
