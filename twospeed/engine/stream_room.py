"""How many streams a step can carry: a waiting request starts only while the decode step it would join stays
within what the streams' ITL objectives allow.

Past some batch a CPU's decode step is compute-bound: another stream adds its rows' time to every other stream's gap
and little throughput: the ~100M Llama in float32 on two AVX2 cores takes about twice as long a step for 32 streams
as for 16 (BENCHMARKS.md), twice every stream's gap for a little more output, before a prompt chunk joins. Where the
streams' lanes have ITL objectives the scheduler admits a request only while the predicted decode step of every
running request and it (each at its context; a request still in its prompt counts as the stream it becomes) leaves
`min_prompt_share` of the tightest objective (Scheduler.itl_cap: x itl_objective_share) to prompt chunks; a request
with nothing running always starts. Without objectives `max_num_seqs` is the bound, as in vLLM: on the overloaded
mixed workload a bound from `max_step_ms` alone kept chat's gaps within 0.25 s but left short prompts queued behind
long ones for 100 s (BENCHMARKS.md), a trade a lane asks for with its objective, not one to impose. Bookkeeping
only, like the scheduler that owns it: no torch, no clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twospeed.engine.cost_model import StepShape
from twospeed.engine.request import Request

if TYPE_CHECKING:
    from twospeed.engine.scheduler import Scheduler


class StreamRoom:
    """The decode step of the running requests, as the cost model prices it; `take` admits one more if it fits."""

    def __init__(self, sched: Scheduler):
        cfg = sched.cfg
        self.sched = sched
        self.enabled = cfg.itl_admission and sched.cost_model is not None and cfg.enable_chunked_prefill
        self.streams = list(sched.running)  # running, then those taken this step
        self.cap = sched.itl_cap(self.streams) if self.enabled else None  # their tightest objective
        self.shape: StepShape | None = None  # their decode step, priced only once a cap asks for it

    def take(self, req: Request) -> bool:
        """req may start: its decode row joins the step within the bound (counted from now on); False: it waits."""
        if not self.enabled:
            return True
        own = self.sched.itl_cap([req])
        cap = min((c for c in (self.cap, own) if c is not None), default=None)
        if cap is not None and self.streams:
            if self.shape is None:
                self.shape = StepShape()
                for r in self.streams:
                    self.shape = _with_stream(self.shape, r)
            shape = _with_stream(self.shape, req)
            if self.sched.cost_model.predict(shape) > cap * (1 - self.sched.cfg.min_prompt_share):
                return False
            self.shape = shape
        elif self.shape is not None:
            self.shape = _with_stream(self.shape, req)
        self.cap = cap
        self.streams.append(req)
        return True


def _with_stream(shape: StepShape, req: Request) -> StepShape:
    """shape plus req's decode row over its whole context so far."""
    return shape.with_chunk(req.num_tokens, 1, True, True)
