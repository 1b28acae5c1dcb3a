"""Continuous batching with one token-accounting rule.

Every request has `num_computed_tokens` of `num_tokens`. Each step fills a
budget of `max_num_batched_tokens`: running decodes first (one token each),
then running requests whose prompt is being chunked (they take what is left),
then waiting requests in policy order, each starting at its prefix-cache hit.
There is no prefill phase and no decode phase: chunked prefill, prefix hits
and recompute after preemption all fall out of the same loop.

The prompt share of a step is sized by time: with streams decoding, prompt
chunks get the most tokens whose predicted step time (a `StepCostModel`,
engine/cost_model.py) stays within the step target, the tightest of the
decoding requests' own (their lane's ITL objective x `itl_objective_share`)
or `target_step_ms`; a chunk ends on a block boundary where it is cut, so
the prefix cache sees whole blocks, and where even one block would miss the
target, one block still goes in (the prompt always advances). Where decodes
alone take the target up, the step may stretch to their time / (1 -
`min_prompt_share`), so prompts keep that share and TTFT does not explode
under load. Decodes are never dropped for it; with nothing decoding a prompt
gets the whole budget.
`max_prefill_tokens_while_decoding` is an explicit cap beside decodes on top.

Short prompts go first (`short_prompts_first`): a waiting prompt whose whole
uncached rest fits the step is admitted ahead of a long prompt being chunked,
while the first prompt in line keeps room for its next block.

When the KV pool runs dry, the lowest-priority running request (fcfs: the
latest to arrive) is preempted: its blocks are freed, it waits again, and
later recomputes its prompt and the tokens it already produced. Bookkeeping
only: no torch and no wall clock of its own (the clock is passed in), so the
planner can drive it with a cost model in place of the model.

Speculation adds draft tokens to a decode chunk (vLLM's num_tokens_with_spec):
the request's `spec_token_ids`, held beside its tokens, get KV slots reserved
with the rest of the chunk and one logits row each. `update_after_step`
counts only the chunk's known tokens as computed; `commit_drafts` adds the
drafts the sampler kept. A rejected draft is never counted, so its slot is
simply written again later: rollback is bookkeeping, no block is freed, and a
draft is hashed into the prefix cache only once it is a kept token. Billing
(`high_water`) follows the same counter, after acceptance.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from twospeed.config import SchedulerConfig
from twospeed.engine.cost_model import StepCostModel, StepShape
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.engine.prompt_share import PromptShare
from twospeed.engine.request import Request, RequestStatus
from twospeed.engine.stream_room import StreamRoom


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request, computed in this step; the last num_draft of them are
    draft tokens (request.spec_token_ids[:num_draft], positions from request.num_tokens on)."""

    request: Request
    start: int
    num_tokens: int
    num_draft: int = 0
    samples: bool = False  # reaches the last known token, so its logits give the next one
    is_decode: bool = False  # computes the token sampled in the previous step (not prompt, not recompute),
    # plus any tokens a grammar forced after it (jump-forward: several new output tokens, one step)

    def __post_init__(self) -> None:
        r = self.request
        self.samples = self.start + self.num_tokens - self.num_draft == r.num_tokens
        self.is_decode = (self.samples and len(r.output_token_ids) > 0 and self.start >= r.high_water
                          and self.start >= r.num_prompt_tokens)

    @property
    def num_logits(self) -> int:
        """Logits rows the chunk needs: 1 + a row per draft token when it samples, else none."""
        return 1 + self.num_draft if self.samples else 0


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)  # what the chunks compute, as the cost model sees it
    predicted_time: float | None = None  # seconds the cost model predicts for the step (None without one)
    target_time: float | None = None  # seconds the step was sized to (None: not sized by time)
    prefill_budget: int = 0  # prompt tokens the step allowed: the time-sized share where time bound, else the
    # token room for prompts (the budget left after decodes, within the cap)
    time_bound: bool = False  # the step target, not the token budget, set the prompt share

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens computed, draft tokens not included (num_draft_tokens)."""
        return sum(c.num_tokens - c.num_draft for c in self.chunks if c.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(c.num_draft for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 cost_model: StepCostModel | None = None):
        self.cfg = cfg
        self.kv = kv
        self.clock = clock
        self.cost_model = cost_model  # None: steps sized by tokens only
        self.waiting: list[Request] = []  # kept sorted by _order
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._seq = itertools.count()  # arrival order, the tie-breaker
        self._arrival_seq: dict[str, int] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of those, found in the prefix cache

    # -- queues ---------------------------------------------------------------------------------
    def _order(self, req: Request) -> tuple:
        seq = self._arrival_seq[req.request_id]
        return (req.priority, seq) if self.cfg.scheduling_policy == "priority" else (seq,)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._arrival_seq[req.request_id] = next(self._seq)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        keys = [self._order(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self._order(req)), req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort): its blocks go back to the pool now."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.clock.finished = self.clock()
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._arrival_seq.pop(req.request_id, None)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.token_budget
        now = self.clock()
        scheduled: dict[str, ScheduledChunk] = {}

        # Decodes first: a stream's next token never waits behind a long prompt that is being chunked.
        # Then prompt chunks of running requests, then waiting requests, within the prompt share.
        decodes = [r for r in self.running if in_decode(r)]
        prompts = [r for r in self.running if not in_decode(r)]
        for req in decodes:
            if budget <= 0:
                break
            if req.status == RequestStatus.RUNNING:  # not preempted by an earlier one of this loop
                n, freed = self._place(req, budget, scheduled, out, drafts=True)
                budget += freed - n
        share = PromptShare(self, list(scheduled.values()), budget)
        streams = StreamRoom(self)
        short = self._short_prompts(share, budget, prompts, streams) if self.cfg.short_prompts_first else []
        budget -= sum(n for _, n in short)
        for req in prompts:
            if share.room(budget) <= 0:
                break
            if req.status == RequestStatus.RUNNING:
                n = share.fit(req, req.num_computed_tokens, budget)
                if n <= 0:
                    break
                n, freed = self._place(req, n, scheduled, out)
                budget += freed - n
                if n:
                    share.add(scheduled[req.request_id])
        # Requests scheduled before a preempted one moved up; keep the running order for the chunk list.
        out.chunks = [scheduled[r.request_id] for r in self.running if r.request_id in scheduled]
        for req, n in short:  # their share was held above; none is admitted in a step that preempted
            cached = self._cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            if (out.preempted or num_cached + n != req.num_tokens
                    or not self.kv.allocate_slots(req.request_id, req.num_tokens, cached)):
                budget += n  # a cached block was evicted meanwhile, or the pool ran short: in line again
                continue
            out.chunks.append(self._admit(req, num_cached, n, now))

        while (self.waiting and share.room(budget) > 0 and len(self.running) < self.cfg.max_num_seqs
               and not out.preempted):
            req = self.waiting[0]
            if not streams.take(req):
                break
            cached = self._cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = req.num_tokens - num_cached
            if not self.cfg.enable_chunked_prefill and n > share.room(budget):
                break
            n = share.fit(req, num_cached, budget, resumes=ScheduledChunk(req, num_cached, n).is_decode)
            if n <= 0 or not self.kv.allocate_slots(req.request_id, num_cached + n, cached):
                break
            out.chunks.append(chunk := self._admit(req, num_cached, n, now))
            share.add(chunk)
            budget -= n
        share.report(out)
        return out

    def _short_prompts(self, share: PromptShare, budget: int, prompts: list[Request],
                       streams: StreamRoom) -> list[tuple[Request, int]]:
        """Waiting prompts whose whole uncached rest fits this step, to be admitted ahead of the prompts they would
        wait behind (their share is held in `share` now): (request, tokens). Under a time-sized step a 2k-token
        prompt is chunked over a second or two, and a 100-token chat prompt queued behind it waited all of that for
        one step's work (chat TTFT p99 1.4 s at 3 req/s on the mixed workload). A prompt overtakes only those of its
        priority or lower, never a preempted request (its cached KV must not be evicted for a newcomer), and only
        where the first prompt in line keeps room for its next block: short prompts cannot starve a long one."""
        if not self.cfg.enable_chunked_prefill or (not prompts and len(self.waiting) < 2):
            return []  # unchunked, a long prompt needs a whole budget (passing it could starve it); or no one to pass
        rank = (lambda r: r.priority) if self.cfg.scheduling_policy == "priority" else (lambda r: 0)
        overtaken = min((rank(r) for r in prompts), default=math.inf)
        picked: list[tuple[Request, int]] = []
        bs, free = self.kv.block_size, self.kv.num_free_blocks
        held = share.shape, share.prefill_tokens
        head = prompts[0] if prompts else None  # the first prompt in line that is not short
        if head is not None:
            budget -= self._hold_block(share, head, head.num_computed_tokens)
        for req in self.waiting[:SHORT_PROMPT_SCAN]:
            if (req.num_preemptions or share.room(budget) <= 0
                    or len(self.running) + len(picked) >= self.cfg.max_num_seqs):
                break
            num_cached = len(self._cached_prefix(req)) * bs
            n = req.num_tokens - num_cached
            blocks = -(-n // bs)
            if (rank(req) <= overtaken and blocks <= free and share.whole(req, num_cached, budget)
                    and streams.take(req)):
                picked.append((req, n))
                share.add(ScheduledChunk(req, num_cached, n))
                budget, free = budget - n, free - blocks
                continue
            overtaken = min(overtaken, rank(req))
            if head is None:
                head = req
                budget -= self._hold_block(share, req, num_cached)
        share.shape, share.prefill_tokens = held  # the head's block was only held open; the picked are placed
        for req, n in picked:
            share.add(ScheduledChunk(req, req.num_tokens - n, n))
        return picked

    def _hold_block(self, share: PromptShare, req: Request, start: int) -> int:
        """Hold room in the share for req's next block (to its next block boundary) from start; its tokens."""
        bs = self.kv.block_size
        n = min(req.num_tokens, (start // bs + 1) * bs) - start
        share.add(ScheduledChunk(req, start, n))
        return n

    def _cached_prefix(self, req: Request) -> list:
        """The cached blocks a waiting request starts from (none for one that must compute every position)."""
        return self.kv.find_cached_prefix(req.all_token_ids, req.block_hashes) if reads_cache(req) else []

    def _admit(self, req: Request, num_cached: int, n: int, now: float) -> ScheduledChunk:
        """A waiting request whose slots are allocated starts running with a chunk of n tokens after its cache hit."""
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        if req.clock.first_scheduled is None:
            req.clock.first_scheduled = now
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += min(num_cached, req.num_prompt_tokens)
        _bill_cache_hit(req, num_cached)
        return ScheduledChunk(req, num_cached, n)

    def step_target(self, decoding: list[Request]) -> float | None:
        """Seconds a step may take with these requests decoding: the tightest of each one's own target (its lane's
        ITL objective x itl_objective_share, else target_step_ms); None = not sized by time."""
        if self.cost_model is None or not decoding or not self.cfg.enable_chunked_prefill:
            return None
        default, share = self.cfg.target_step_time, self.cfg.itl_objective_share
        own = [r.itl_target * share if r.itl_target is not None and share > 0 else default for r in decoding]
        target = min((t for t in own if t is not None), default=None)
        return None if target is None or math.isinf(target) else target

    def step_cap(self, decoding: list[Request]) -> float:
        """Seconds a step may grow to for queued prompts: the tightest ITL objective of the decoding requests
        (x itl_objective_share), else max_step_ms."""
        cap = self.itl_cap(decoding)
        return self.cfg.max_step_ms / 1e3 if cap is None else cap

    def itl_cap(self, decoding: list[Request]) -> float | None:
        """Seconds no step is planned past, decodes alone aside: the tightest ITL objective of these requests (x
        itl_objective_share); None where none has one. An objective is a promise kept strictly (a stream starts only
        within it, a prompt's block is cut to it, decodes that fill the target stretch the step only up to it);
        without one a step may stretch further under load, as throughput and TTFT ask."""
        share = self.cfg.itl_objective_share
        own = [r.itl_target * share for r in decoding
               if r.itl_target is not None and not math.isinf(r.itl_target) and share > 0]
        return min(own, default=None)

    def queued_prefill_rate(self) -> float:
        """Prompt tokens per second that keep every queued prompt (part-computed, then waiting, in the order they
        are served) within ttft_target_ms of its arrival: the largest tokens-ahead-and-its-own / time-it-has-left
        over the queue. 0 when off or nothing is queued."""
        horizon = (self.cfg.ttft_target_ms or 0) / 1e3
        if not horizon or self.cost_model is None:
            return 0.0
        now = self.clock()
        floor = self.cfg.target_step_time or 0.05  # a prompt already late asks for its tokens within about a step
        rate, ahead = 0.0, 0
        for req in [r for r in self.running if not in_decode(r)] + self.waiting[:QUEUE_SCAN]:
            done = (req.num_computed_tokens if req.status == RequestStatus.RUNNING
                    else self.kv.cached_prefix_len(req.all_token_ids, req.block_hashes) if reads_cache(req) else 0)
            ahead += max(0, req.num_tokens - done)
            left = req.clock.arrival + horizon - now
            rate = max(rate, ahead / max(left, floor))
        return rate

    def _place(self, req: Request, room: int, scheduled: dict[str, ScheduledChunk],
               out: SchedulerOutput, drafts: bool = False) -> tuple[int, int]:
        """Schedule up to `room` tokens of running `req` (with drafts: its draft tokens after them, as many as fit),
        preempting the lowest-priority running requests while blocks run out (possibly `req` itself). Returns
        (tokens scheduled, budget given back by preemptions)."""
        known = req.num_tokens - req.num_computed_tokens
        n = min(known + (len(req.spec_token_ids) if drafts else 0), room)
        freed = 0
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            if n > known:  # the drafts' slots are what does not fit: drop them before preempting anyone
                n = known
                continue
            victim = max(self.running, key=self._order)
            freed += self._preempt(victim, scheduled, out)
            if victim is req:
                return 0, freed
        scheduled[req.request_id] = ScheduledChunk(req, req.num_computed_tokens, n, num_draft=max(0, n - known))
        return n, freed

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledChunk], out: SchedulerOutput) -> int:
        """Free the victim's blocks and send it back to waiting; returns budget given back."""
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.spec_token_ids.clear()
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self._enqueue(victim)
        self.num_preemptions += 1
        out.preempted.append(victim)
        chunk = scheduled.pop(victim.request_id, None)
        return chunk.num_tokens if chunk else 0

    def update_after_step(self, out: SchedulerOutput, now: float) -> None:
        """The model computed the step's chunks: advance counters over their known tokens (drafts wait for
        commit_drafts), bill them, cache full blocks, stamp the clock."""
        has_prefill = out.num_prefill_tokens > 0
        for chunk in out.chunks:
            req = chunk.request
            if chunk.is_decode:
                req.clock.decode_steps += 1
                if has_prefill:
                    req.clock.interfered_steps += 1
            end = chunk.start + chunk.num_tokens - chunk.num_draft
            _bill_positions(req, chunk.start, end)
            req.num_computed_tokens = end
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, end)
            if req.clock.prefill_done is None and req.num_computed_tokens >= req.num_prompt_tokens:
                req.clock.prefill_done = now

    def commit_drafts(self, req: Request, num_kept: int) -> None:
        """The sampler kept the first num_kept draft tokens of req's verify chunk (now its tokens): their KV, computed
        this step, counts as computed, is billed and its full blocks are cached. The rest never counted."""
        if num_kept <= 0 or req.is_finished:
            return
        start = req.num_computed_tokens
        end = min(start + num_kept, req.num_tokens)
        _bill_positions(req, start, end)
        req.num_computed_tokens = end
        self.kv.cache_full_blocks(req.request_id, req.all_token_ids, end)


# Waiting requests looked at each step for a prompt short enough to go first (Scheduler._short_prompts): each look
# hashes the prompt's cached blocks, so the scan is bounded.
SHORT_PROMPT_SCAN = 16
# Queued prompts looked at for the prefill pace a step must keep (Scheduler.queued_prefill_rate).
QUEUE_SCAN = 64


def reads_cache(req: Request) -> bool:
    """A request asking for prompt logprobs computes its whole prompt: a prefix-cache hit has no logits."""
    return req.params.prompt_logprobs is None


def in_decode(req: Request) -> bool:
    """Its prompt is computed and it is not recomputing: its next chunk is the token it just sampled
    (plus any a grammar forced after it)."""
    return bool(req.output_token_ids) and req.num_computed_tokens >= max(req.high_water, req.num_prompt_tokens)


# Billing: each prompt position is billed once, by how the request first got its KV: from the prefix
# cache (cached_tokens) or by computing it (prefilled_tokens). Every later computation of a position
# (after a preemption dropped it) is a recomputed token. Positions [0, high_water) have been seen:
# admission and chunks always run contiguously from position 0, so one number tracks them. Chunks are billed
# once computed (update_after_step), draft positions once kept (commit_drafts): a rejected draft's slot is
# computed again later without counting as recomputed.
def _bill_cache_hit(req: Request, num_cached: int) -> None:
    p = req.num_prompt_tokens
    req.bill.cached_tokens += max(0, min(num_cached, p) - min(req.high_water, p))
    req.high_water = max(req.high_water, num_cached)


def _bill_positions(req: Request, start: int, end: int) -> None:
    p = req.num_prompt_tokens
    req.bill.recomputed_tokens += max(0, min(end, req.high_water) - start)
    req.bill.prefilled_tokens += max(0, min(end, p) - min(max(start, req.high_water), p))
    req.high_water = max(req.high_water, end)
