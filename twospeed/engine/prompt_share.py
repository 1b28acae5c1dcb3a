"""The prompt share of one step: how many prompt tokens may join the decodes already placed in it.

The token budget bounds it; beside decodes, the explicit cap (`max_prefill_tokens_while_decoding`) and the step
target do too: the step's time, predicted by the scheduler's cost model (engine/cost_model.py), stays within the
tightest target of the decoding requests (Scheduler.step_target), stretched where decodes alone take more than (1 -
`min_prompt_share`) of it, up to the decoding streams' ITL objectives (Scheduler.itl_cap). A chunk cut by the target
ends on a block boundary, so the prefix cache sees whole blocks; a step's first prompt chunk that cannot fit even
one block gets one block, so a prompt always advances, or where one block would take the step past those objectives,
what fits of it (one token at least): an objective is a promise, the target only a wish. Bookkeeping only, like the
scheduler that owns it: no torch, no clock.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from twospeed.engine.cost_model import StepShape
from twospeed.engine.request import Request

if TYPE_CHECKING:
    from twospeed.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput


class PromptShare:
    """How many prompt tokens the rest of a step may take: the token budget; beside decodes, the cap and the step
    target (the step's predicted time within it; a chunk cut by it ends on a block boundary; a first chunk that
    cannot fit even one block gets one block)."""

    def __init__(self, sched: Scheduler, decodes: list[ScheduledChunk], budget: int):
        cfg = sched.cfg
        self.sched = sched
        self.block_size = sched.kv.block_size
        self.cap = cfg.max_prefill_tokens_while_decoding if cfg.enable_chunked_prefill else None
        self.decoding = [c.request for c in decodes]
        self.decode_shape = self.shape = StepShape.from_chunks(decodes)
        self.target = self._effective(sched.step_target(self.decoding))
        if self.target is not None:
            self.target = max(self.target, self._for_queue(sched.queued_prefill_rate()))
        self.prefill_tokens = 0  # placed this step
        self.time_bound = False  # the target cut or refused a chunk
        self.allowance = self.room(budget)

    def room(self, budget: int) -> int:
        """Tokens the budget and the cap leave for prompt chunks."""
        if self.cap is not None and self.decoding:
            return min(budget, self.cap - self.prefill_tokens)
        return budget

    def whole(self, req: Request, start: int, budget: int) -> bool:
        """req's tokens from position start all fit this step: within the budget, the cap and the target."""
        n = req.num_tokens - start
        return 0 < n <= self.room(budget) and (self.target is None or self._within(start, n, False, req, self.target))

    def fit(self, req: Request, start: int, budget: int, resumes: bool = False) -> int:
        """Tokens of req from position start this step can take (0: none). resumes: its chunk is a decode (a
        preempted stream whose KV is all in the prefix cache again)."""
        n = min(req.num_tokens - start, self.room(budget))
        if resumes:  # joins only within the cap and the target (its own too): it is a stream again
            if self.cap is not None and self.prefill_tokens > self.cap:
                return 0
            own = self._effective(self.sched.step_target([req]))
            target = min((t for t in (self.target, own) if t is not None), default=None)
            if self.prefill_tokens and target is not None and not self._within(start, n, True, req, target):
                self.time_bound = True
                return 0
            return n
        if n <= 0 or self.target is None or self._within(start, n, False, req, self.target):
            return max(n, 0)
        self.time_bound = True
        bs = self.block_size
        sizes = range((start // bs + 1) * bs - start, n, bs)  # chunks that end on a block boundary inside this one
        fit = self._fitting(req, start, sizes, self.target)
        if fit:
            return sizes[fit - 1]
        if self.prefill_tokens:
            return 0
        return self._first_block(req, start, sizes[0] if sizes else n)

    def _first_block(self, req: Request, start: int, n: int) -> int:
        """The tokens of a step's first prompt chunk where none fits the target: its next block (n tokens), or where
        that would take the step past the decoding streams' ITL objectives, the most of them within, one at least."""
        cap = self.sched.itl_cap(self.decoding)
        return n if cap is None else max(1, self._fitting(req, start, range(1, n + 1), cap))

    def _fitting(self, req: Request, start: int, sizes: range, target: float) -> int:
        """How many of the chunk sizes (ascending) keep the step within target: a step's predicted time never falls
        as a chunk grows, so they are a prefix, found by bisection."""
        return bisect.bisect_left(sizes, True, key=lambda m: not self._within(start, m, False, req, target))

    def _effective(self, target: float | None) -> float | None:
        """The target, stretched where decodes alone take more than (1 - min_prompt_share) of it, never past the
        decoding streams' ITL objectives (Scheduler.itl_cap)."""
        share = self.sched.cfg.min_prompt_share
        if target is None or not share:
            return target
        stretched = self.sched.cost_model.predict(self.decode_shape) / (1 - share)
        cap = self.sched.itl_cap(self.decoding)
        return max(target, stretched if cap is None else min(stretched, cap))

    def _for_queue(self, rate: float) -> float:
        """The step time at which prompt tokens go at `rate` tokens/s beside this step's decodes, within the ITL
        cap: d + p x with x / (d + p x) = rate, d the decodes' time and p a prompt token's (from the cost model);
        the cap where no step is long enough (p * rate >= 1)."""
        if rate <= 0:
            return 0.0
        cap = self.sched.step_cap(self.decoding)
        model = self.sched.cost_model
        d = model.predict(self.decode_shape)
        probe = 512
        p = (model.predict(self.decode_shape.with_chunk(0, probe, False, True)) - d) / probe
        if p <= 0 or p * rate >= 1:
            return cap
        return min(cap, d + p * rate * d / (1 - p * rate))

    def _within(self, start: int, n: int, is_decode: bool, req: Request, target: float) -> bool:
        """The step with this chunk added is predicted within target (a part in 1e9 spared for float rounding)."""
        shape = self.shape.with_chunk(start, n, is_decode, start + n == req.num_tokens)
        return self.sched.cost_model.predict(shape) <= target * (1 + 1e-9)

    def add(self, chunk: ScheduledChunk) -> None:
        """A chunk was placed."""
        self.shape = self.shape.with_chunk(chunk.start, chunk.num_tokens, chunk.is_decode, chunk.samples,
                                           chunk.num_draft)
        if not chunk.is_decode:
            self.prefill_tokens += chunk.num_tokens
        elif chunk.request not in self.decoding:  # a stream resumed: the step now carries a decode
            self.decoding.append(chunk.request)
            self.decode_shape = self.decode_shape.with_chunk(chunk.start, chunk.num_tokens, True, chunk.samples,
                                                             chunk.num_draft)
            self.target = self._effective(self.sched.step_target(self.decoding))

    def report(self, out: SchedulerOutput) -> None:
        out.shape = StepShape.from_chunks(out.chunks)
        out.target_time = self.target
        model = self.sched.cost_model
        out.predicted_time = model.predict(out.shape) if model is not None else None
        out.prefill_budget = self.prefill_tokens if self.time_bound else self.allowance
        out.time_bound = self.time_bound
