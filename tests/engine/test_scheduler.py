"""Scheduler bookkeeping without a model: exact step-by-step chunk lists, then random operations.

A `Sim` drives `Scheduler` + `KVCacheManager` as `LLMEngine.step()` does (schedule, "run",
update_after_step, sample one token per sampling chunk, the engine's stop policy), with a fake
clock and a fake model whose next token depends only on the tokens so far, so a request's
output is the same whatever the batch, chunking or preemption. The "runner" writes each
computed position's prefix into the slot its block table names, so a test can check that
every computed position of every running request reads back KV of its own prefix.
With `drafts` the Sim speculates too: each decoding request gets up to gamma draft tokens,
a random number of them right (the fake model's own continuation) and the rest wrong; the
verify step keeps the right ones, emits the next token, and commits the kept drafts.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from twospeed.config import SchedulerConfig
from twospeed.engine.cost_model import LinearCostModel, StepShape
from twospeed.engine.kv_cache import KVCacheManager, hash_block_tokens
from twospeed.engine.request import Request, RequestStatus
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.scheduler import Scheduler, SchedulerOutput, in_decode
from twospeed.engine.stop import finish_if_stopped


def fake_token(tokens: list[int]) -> int:
    """The fake model: deterministic in the tokens so far (like greedy on a real model)."""
    return 3 + (sum(tokens[-3:]) * 7 + len(tokens)) % 50


class FakeCost:
    """A step costs `base` plus `per_token` per token computed (seconds), whatever kind."""

    def __init__(self, base: float = 1e-3, per_token: float = 1e-3):
        self.base, self.per_token = base, per_token

    def predict(self, shape: StepShape) -> float:
        return self.base + self.per_token * shape.num_tokens if shape.num_tokens else 0.0

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass


class Sim:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True, cost_model=None,
                 drafts: random.Random | None = None, gamma: int = 3, **sched):
        self.t = 0.0
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        # the sim's clock runs a second a step: the queue's TTFT pace is off unless a test asks for it
        self.cfg = SchedulerConfig(**{"ttft_target_ms": None, **sched})
        self.cost = cost_model
        self.sched = Scheduler(self.cfg, self.kv, clock=lambda: self.t, cost_model=cost_model)
        self.slots: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.outputs: list[SchedulerOutput] = []
        self.computed: Counter[str] = Counter()  # known tokens computed per request, over all incarnations
        self.kept: Counter[str] = Counter()  # draft tokens kept per request (computed in verify chunks)
        self.reqs: dict[str, Request] = {}
        self.drafts, self.gamma = drafts, gamma
        self.real_hashes: set = set()  # every block hash of a real (prompt + kept output) token sequence

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=self.t,
                      priority=priority, max_output_tokens=max_tokens)
        self.sched.add_request(req)
        self.reqs[rid] = req
        return req

    def propose(self) -> None:
        """Draft tokens for every decoding request: a random count, a random number of them right."""
        for r in self.sched.running:
            r.spec_token_ids = []
            room = min((self.cfg.max_model_len or 10**9) - r.num_tokens, r.max_output_tokens - len(r.output_token_ids) - 1)
            if not in_decode(r) or room <= 0:
                continue
            k = self.drafts.randint(0, min(self.gamma, room))
            right = self.drafts.randint(0, k)
            seq = list(r.all_token_ids)
            for i in range(k):
                token = fake_token(seq)
                seq.append(token if i < right else 3 + (token - 3 + 1 + self.drafts.randrange(49)) % 50)
            r.spec_token_ids = seq[r.num_tokens:]

    def step(self) -> SchedulerOutput:
        """Step k schedules at time k and finishes (update, sample, stamp) at k + 0.5."""
        self.t = math.floor(self.t) + 1.0
        if self.drafts is not None:
            self.propose()
        before = {r.request_id for r in self.sched.running}
        out = self.sched.schedule()
        self.check_streams([r for r in self.sched.running if r.request_id not in before])
        for c in out.chunks:  # the runner: write the KV of positions [start, start + n), drafts included
            r = c.request
            seq = r.all_token_ids + r.spec_token_ids[:c.num_draft]
            table = self.kv.block_ids(r.request_id)
            assert len(table) * self.bs >= c.start + c.num_tokens, f"{r} table too short for {c}"
            for p in range(c.start, c.start + c.num_tokens):
                block = self.kv.pool.blocks[table[p // self.bs]]
                assert block.ref_cnt == 1, f"{r} writes position {p} into shared block {block.block_id}"
                self.slots[block.block_id][p % self.bs] = tuple(seq[: p + 1])
            self.computed[r.request_id] += c.num_tokens - c.num_draft
        cap = self.cfg.max_prefill_tokens_while_decoding
        if cap is not None and self.cfg.enable_chunked_prefill and out.num_decode_tokens:
            assert out.num_prefill_tokens <= cap, f"{out.num_prefill_tokens} prefill tokens beside decodes"
        self.check_step_time(out)
        self.t += 0.5
        self.sched.update_after_step(out, self.t)
        for c in out.chunks:
            r = c.request
            if c.samples:
                self.sample(r, r.spec_token_ids[:c.num_draft])
            self.note_real(r.all_token_ids)
        for r in self.sched.running:
            r.spec_token_ids = []
        self.outputs.append(out)
        return out

    def sample(self, r: Request, draft: list[int]) -> None:
        """The verify step of the fake model: drafts kept while they are its own next token, then one token more;
        each appended through the length check; the kept drafts committed."""
        emitted = []
        for d in draft + [None]:
            token = fake_token(r.all_token_ids + emitted)
            emitted.append(token)
            if token != d:
                break
        appended, stop = 0, None
        for token in emitted:  # one at a time through the engine's stop policy
            r.append_token(token, self.t)
            appended += 1
            if (stop := finish_if_stopped(self.sched, r, [token])) is not None:
                break
        kept = max(0, min(appended - 1, len(draft)))
        self.kept[r.request_id] += kept
        if stop is None:
            self.sched.commit_drafts(r, kept)

    def note_real(self, tokens: list[int]) -> None:
        parent = None
        for i in range(len(tokens) // self.bs):
            parent = hash_block_tokens(parent, tokens[i * self.bs:(i + 1) * self.bs])
            self.real_hashes.add(parent)

    def check_streams(self, started: list[Request]) -> None:
        """Where requests started this step beside others, the decode step of every running request (each at its
        context) is predicted within min_prompt_share of their tightest ITL objective (x itl_objective_share): a
        stream starts only where it fits."""
        running = self.sched.running
        cap = self.sched.itl_cap(running)
        if not (started and len(running) > 1 and self.cost is not None and self.cfg.itl_admission
                and self.cfg.enable_chunked_prefill and cap is not None):
            return
        shape = StepShape()
        for r in running:
            shape = shape.with_chunk(r.num_tokens, 1, True, True)
        bound = cap * (1 - self.cfg.min_prompt_share)
        assert self.cost.predict(shape) <= bound * (1 + 1e-9), f"{ids(running)} started past {bound}"

    def check_step_time(self, out: SchedulerOutput) -> None:
        """With decodes in the step and a target, the predicted step time is within the tightest decoding request's
        target, unless the step's prompt share is one chunk of at most a block (the prompt must advance)."""
        if self.cost is None or not self.cfg.enable_chunked_prefill or not out.num_prefill_tokens:
            return
        share, default = self.cfg.itl_objective_share, self.cfg.target_step_time
        decodes = [c for c in out.chunks if c.is_decode]
        own = [c.request.itl_target * share if c.request.itl_target is not None and share > 0 else default
               for c in decodes]
        target = min((t for t in own if t is not None), default=math.inf)
        # where decodes alone take the target up, prompts still get min_prompt_share of the step
        target = max(target, self.cost.predict(StepShape.from_chunks(decodes)) / (1 - self.cfg.min_prompt_share))
        if out.preempted:  # a preempted stream's decode was counted when the share was sized: it only loosens
            target = max(target, out.target_time or 0.0)
        if self.cfg.ttft_target_ms:  # queued prompts may grow the step up to the decodes' ITL cap
            target = max(target, self.sched.step_cap([c.request for c in decodes]))
        predicted = self.cost.predict(StepShape.from_chunks(out.chunks))
        prompts = [c for c in out.chunks if not c.is_decode]
        one_block = len(prompts) == 1 and prompts[0].num_tokens <= self.bs
        assert predicted <= target * (1 + 1e-9) or one_block, (f"predicted {predicted} over target {target}: "
                                                          f"{chunks(out)}")
        assert out.predicted_time == predicted

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"still unfinished after {max_steps} steps: {self.sched.running} {self.sched.waiting}")


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt):]


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# --- exact expectations ------------------------------------------------------


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                   "max_prefill_tokens_while_decoding"])
def test_scheduler_config_rejects_limits_below_one(field):
    with pytest.raises(ValueError, match=">= 1"):
        SchedulerConfig(**{field: 0})
    SchedulerConfig(**{field: 1})
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


def test_token_budget_and_chunked_prefill():
    sim = Sim(32, 4, max_num_batched_tokens=8, short_prompts_first=False)  # in arrival order
    a = sim.add("a", list(range(10, 20)), 3)
    b = sim.add("b", [7, 8, 9], 2)

    out = sim.step()
    assert chunks(out) == [("a", 0, 8)]  # the budget is spent on a's first chunk; b waits
    assert not out.chunks[0].samples and a.output_token_ids == []
    assert a.clock.first_scheduled == 1.0 and a.clock.prefill_done is None
    assert b.clock.first_scheduled is None and b.status == RequestStatus.WAITING

    out = sim.step()
    assert chunks(out) == [("a", 8, 2), ("b", 0, 3)]
    assert [c.samples for c in out.chunks] == [True, True]
    assert out.num_prefill_tokens == 5 and out.num_decode_tokens == 0
    assert a.clock.prefill_done == 2.5 and b.clock.first_scheduled == 2.0 and b.clock.prefill_done == 2.5

    out = sim.step()
    assert chunks(out) == [("a", 10, 1), ("b", 3, 1)]
    assert [c.is_decode for c in out.chunks] == [True, True]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.clock.finished == 3.5

    assert chunks(sim.step()) == [("a", 11, 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 3)
    assert not sim.sched.has_unfinished() and sim.kv.num_free_blocks == 32
    assert all(o.num_tokens <= 8 for o in sim.outputs)
    assert a.bill.prefilled_tokens == 10 and a.bill.cached_tokens == 0 and a.bill.recomputed_tokens == 0


def test_running_decodes_go_before_new_prefills():
    sim = Sim(32, 4, max_num_batched_tokens=8)
    a = sim.add("a", [5, 6, 7, 8], 5)
    assert chunks(sim.step()) == [("a", 0, 4)]
    b = sim.add("b", list(range(30, 50)), 1)
    steps = [chunks(sim.step()) for _ in range(4)]
    assert steps == [
        [("a", 4, 1), ("b", 0, 7)],  # a's decode first, b's chunk takes what is left
        [("a", 5, 1), ("b", 7, 7)],
        [("a", 6, 1), ("b", 14, 6)],
        [("a", 7, 1)],
    ]
    assert [o.num_decode_tokens for o in sim.outputs] == [0, 1, 1, 1, 1]
    assert [o.num_prefill_tokens for o in sim.outputs] == [4, 7, 7, 6, 0]
    assert a.clock.decode_steps == 4 and a.clock.interfered_steps == 3
    assert b.clock.decode_steps == 0 and b.output_token_ids == expected_output(b.prompt_token_ids, 1)
    assert b.clock.first_scheduled == 2.0 and b.clock.prefill_done == 4.5
    assert not sim.sched.has_unfinished()


def test_prefill_cap_beside_decodes():
    sim = Sim(64, 4, max_num_batched_tokens=16, max_prefill_tokens_while_decoding=5, short_prompts_first=False)
    sim.add("long", list(range(30, 70)), 2)  # 40 tokens
    assert chunks(sim.step()) == [("long", 0, 16)]  # nothing decodes yet: the whole budget
    sim.add("chat", [5, 6, 7], 6)
    assert chunks(sim.step()) == [("long", 16, 16)]  # chat waits (FCFS), still no decode
    assert chunks(sim.step()) == [("long", 32, 8), ("chat", 0, 3)]
    # now chat decodes: prompt chunks beside it get at most 5 tokens a step
    sim.add("late", list(range(80, 92)), 1)
    assert chunks(sim.step()) == [("long", 40, 1), ("chat", 3, 1), ("late", 0, 5)]
    assert chunks(sim.step()) == [("chat", 4, 1), ("late", 5, 5)]
    sim.run()
    assert all(o.num_prefill_tokens <= 5 for o in sim.outputs[3:] if o.num_decode_tokens)
    assert sim.kv.num_free_blocks == 64


def test_prompt_share_sized_by_time_beside_decodes():
    """A step costs 1 ms + 1 ms per token (FakeCost); the target is 10 ms: beside a decode, a prompt gets the most
    whole blocks that keep the step within 10 ms; with nothing decoding, the whole budget."""
    sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=10)
    chat = sim.add("chat", [5, 6, 7], 6)
    out = sim.step()
    assert chunks(out) == [("chat", 0, 3)] and out.target_time is None and not out.time_bound
    sim.add("long", list(range(30, 70)), 2)  # 40 tokens
    out = sim.step()  # 1 ms + chat's token + 8 prompt tokens = 10 ms; 12 tokens would be 14 ms
    assert chunks(out) == [("chat", 3, 1), ("long", 0, 8)]
    assert out.target_time == 0.010 and out.predicted_time == pytest.approx(0.010) and out.time_bound
    assert out.prefill_budget == 8
    assert chunks(sim.step()) == [("chat", 4, 1), ("long", 8, 8)]
    sim.run()
    assert chat.output_token_ids == expected_output(chat.prompt_token_ids, 6)
    alone = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=10)
    alone.add("long", list(range(30, 70)), 2)
    out = alone.step()
    assert chunks(out) == [("long", 0, 40)] and out.predicted_time == pytest.approx(0.041)  # nobody waits on it
    assert out.prefill_budget == 64 and not out.time_bound


def test_queued_prompts_grow_the_step_up_to_the_itl_cap():
    """FakeCost (1 ms a step and a token), a 10 ms target, TTFT pace 40 ms (the sim's clock runs 1 s a step, so a
    queued prompt is late from its first step): beside a stream without an ITL objective, a late 40-token prompt
    takes the step up to max_step_ms (30 ms: 28 prompt tokens, whole blocks) instead of the target's 8; beside a
    stream whose lane has a 20 ms ITL objective (x 0.8), up to 16 ms. A queue that keeps its pace leaves the target
    as it is."""
    def late_prompt(itl_target=None, **cfg) -> tuple[Sim, SchedulerOutput]:
        sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, **{"target_step_ms": 10,
                  "ttft_target_ms": 40, "max_step_ms": 30, **cfg})
        sim.add("chat", [5, 6, 7], 20).itl_target = itl_target
        sim.step()
        sim.add("long", list(range(30, 70)), 2).clock.arrival = sim.t - 5.0  # waited 5 s already
        return sim, sim.step()

    sim, out = late_prompt()
    assert chunks(out) == [("chat", 3, 1), ("long", 0, 28)]
    assert out.target_time == pytest.approx(0.030) and out.predicted_time == pytest.approx(0.030)
    sim.run()
    _, out = late_prompt(itl_target=0.020)
    assert chunks(out) == [("chat", 3, 1), ("long", 0, 12)] and out.target_time == pytest.approx(0.016)
    _, out = late_prompt(ttft_target_ms=None)  # the pace off: the step target alone
    assert chunks(out) == [("chat", 3, 1), ("long", 0, 8)] and out.target_time == pytest.approx(0.010)

    on_time = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=10, ttft_target_ms=1e6)
    on_time.add("chat", [5, 6, 7], 20)
    on_time.step()
    on_time.add("long", list(range(30, 70)), 2)
    assert chunks(on_time.step()) == [("chat", 3, 1), ("long", 0, 8)]  # 40 tokens due in 1000 s: no hurry


def test_the_queue_pace_counts_cached_prefixes_and_computed_chunks():
    """queued_prefill_rate: tokens still to compute ahead of and including each queued prompt, over the time it
    has left; a cached prefix and a computed chunk are not work; a lookup ahead is not a prefix-cache query."""
    sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=8, target_step_ms=10, ttft_target_ms=2000)
    sim.add("warm", list(range(10, 27)), 1)
    sim.run()  # its 16 full-block tokens stay cached
    t = sim.t
    sim.add("a", list(range(10, 27)) + [99], 1).clock.arrival = t - 1.0  # 16 cached: 2 to compute, 1 s left
    sim.add("b", list(range(40, 50)), 1).clock.arrival = t  # 10 more: 12 due in 2 s
    queries = sim.kv.prefix_cache_queries
    assert sim.sched.queued_prefill_rate() == pytest.approx(max(2 / 1.0, 12 / 2.0))
    assert sim.kv.prefix_cache_queries == queries


def test_one_block_goes_in_where_none_fits():
    """Decodes alone already take the 2 ms target: the first prompt still gets one block, the next none."""
    sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=2)
    sim.add("chat", [5, 6, 7], 4)
    sim.step()
    sim.add("long", list(range(30, 50)), 1)
    sim.add("short", [8, 9], 1)
    out = sim.step()
    assert chunks(out) == [("chat", 3, 1), ("long", 0, 4)] and out.predicted_time == pytest.approx(0.006)
    assert chunks(sim.step()) == [("chat", 4, 1), ("long", 4, 4)]
    assert ids(sim.sched.waiting) == ["short"]  # the one block per step went to the prompt ahead of it


def test_a_block_past_the_itl_objective_goes_in_part():
    """A stream decodes (FakeCost: 2 ms) under a 2 ms target: the first prompt gets one block (4 tokens, 6 ms) where
    the stream has no ITL objective; where its lane's objective allows 5 ms (6.25 ms x 0.8), the 3 tokens of it that
    keep the step within it, then the one token to the block's end."""
    def steps(itl_target: float | None) -> list:
        sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=2, itl_admission=False)
        sim.add("chat", [5, 6, 7], 6).itl_target = itl_target
        sim.step()
        sim.add("long", list(range(30, 50)), 1)
        outs = [sim.step(), sim.step()]
        sim.run()
        assert sim.reqs["chat"].output_token_ids == expected_output([5, 6, 7], 6)
        return [chunks(o) for o in outs] + [max(o.predicted_time for o in outs)]
    assert steps(None) == [[("chat", 3, 1), ("long", 0, 4)], [("chat", 4, 1), ("long", 4, 4)], pytest.approx(0.006)]
    assert steps(0.00625) == [[("chat", 3, 1), ("long", 0, 3)], [("chat", 4, 1), ("long", 3, 1)],
                              pytest.approx(0.005)]


def chunking_long_prompt(**cfg) -> Sim:
    """A stream decoding beside a 40-token prompt being chunked under a 10 ms target (FakeCost: 1 ms a step and a
    token): after two steps the stream is at position 4 and the prompt at 8."""
    sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=10, **cfg)
    sim.add("chat", [5, 6, 7], 20)
    sim.step()
    sim.add("long", list(range(30, 70)), 2)
    assert chunks(sim.step()) == [("chat", 3, 1), ("long", 0, 8)]
    return sim


def test_a_short_prompt_goes_before_a_long_one_being_chunked():
    """A 3-token prompt arriving while a 40-token one is chunked goes in whole, in the step it arrives; the long
    one keeps a block of that step and the step stays within its target. In arrival order it would wait the long
    prompt's whole prefill (four more steps here, a second or two of 50 ms steps for a 2k-token RAG prompt)."""
    sim = chunking_long_prompt()
    short = sim.add("short", [8, 9, 10], 2)
    out = sim.step()
    assert chunks(out) == [("chat", 4, 1), ("long", 8, 4), ("short", 0, 3)]
    assert out.predicted_time == pytest.approx(0.009) and out.target_time == 0.010  # a second block: 13 ms
    assert short.clock.prefill_done is not None and len(short.output_token_ids) == 1
    fcfs = chunking_long_prompt(short_prompts_first=False)
    late = fcfs.add("short", [8, 9, 10], 2)
    assert chunks(fcfs.step()) == [("chat", 4, 1), ("long", 8, 8)]
    steps = 1
    while late.clock.prefill_done is None:
        fcfs.step()
        steps += 1
    assert steps == 5  # the long prompt's 32 tokens went first, 8 a step; then the short one
    sim.run()
    assert short.output_token_ids == expected_output(short.prompt_token_ids, 2)


def test_short_prompts_cannot_starve_a_long_one():
    """A new short prompt every step, each of which would fit the step: the long prompt still advances a block a
    step and finishes its prefill."""
    sim = chunking_long_prompt()
    long = sim.reqs["long"]
    for i in range(12):
        before = long.num_computed_tokens
        sim.add(f"s{i}", [8, 9, 10 + i % 3], 1)
        out = sim.step()
        assert long.num_computed_tokens >= min(before + 4, long.num_prompt_tokens), chunks(out)
        assert out.predicted_time <= out.target_time * (1 + 1e-9)
    assert long.clock.prefill_done is not None
    sim.run()


def test_a_short_prompt_overtakes_only_its_priority_or_lower():
    sim = chunking_long_prompt(scheduling_policy="priority")
    sim.add("low", [8, 9, 10], 2, priority=1)  # lower priority than the long prompt (0): waits
    assert chunks(sim.step()) == [("chat", 4, 1), ("long", 8, 8)]
    sim.add("same", [11, 12, 13], 2, priority=0)  # arrived later but as urgent as the long prompt: goes first
    assert chunks(sim.step()) == [("chat", 5, 1), ("long", 16, 4), ("same", 0, 3)]


def test_prompts_keep_a_share_where_decodes_alone_take_the_target_up():
    """Eight streams take 9 ms alone against a 2 ms target: with min_prompt_share 0.5 the step may take 18 ms (two
    blocks of prompt fit, 17 ms); strictly (share 0), one block a step."""
    def second_step(share: float):
        sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=2,
                  min_prompt_share=share)
        for i in range(8):
            sim.add(f"s{i}", [5, 6, 7 + i], 4)
        sim.step()
        sim.add("long", list(range(30, 70)), 1)
        out = sim.step()
        return [c.num_tokens for c in out.chunks if not c.is_decode], out.target_time
    assert second_step(0.5) == ([8], pytest.approx(0.018))
    assert second_step(0.0) == ([4], pytest.approx(0.002))


def test_the_tightest_decoding_lane_sets_the_target():
    """Request.itl_target (the server sets it from the lane's ITL objective) x itl_objective_share, the tightest of
    those decoding; a lane with objectives but none on ITL (inf) does not limit the step."""
    def run(targets: dict[str, float | None]) -> list:
        sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=50,
                  itl_objective_share=0.5)
        for rid, target in targets.items():
            sim.add(rid, [5, 6, 7], 6).itl_target = target
        sim.step()
        sim.add("long", list(range(30, 70)), 2)
        out = sim.step()
        return [chunks(out), out.target_time]
    decodes = [("a", 3, 1), ("b", 3, 1)]
    assert run({"a": 0.030, "b": None}) == [decodes + [("long", 0, 12)], 0.015]  # 1 + 2 + 12 ms
    assert run({"a": 0.030, "b": 0.020}) == [decodes + [("long", 0, 4)], 0.010]  # 7 tokens fit: one block of 4
    assert run({"a": math.inf, "b": None})[1] == 0.050  # b has no lane SLO: the default
    assert run({"a": math.inf, "b": math.inf}) == [decodes + [("long", 0, 40)], None]


def test_streams_start_only_while_their_decode_step_fits_the_objective():
    """A step costs 1 ms + 1 ms a row (FakeCost), min_prompt_share 0.5. Under a 12.5 ms ITL objective (x 0.8: 10
    ms) decodes may take 5 ms, so four streams run and four wait, each starting as one finishes, every output the
    fake model's own (four also where every other request has it); under 20 ms (16 ms) seven run; without
    objectives, or with itl_admission off, all eight (as vLLM admits)."""
    def crowd(itl_target=None, **cfg) -> tuple[Sim, list[Request], list[int]]:
        sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=64, target_step_ms=2, **cfg)
        reqs = [sim.add(f"s{i}", [5, 6, 7 + i], 6) for i in range(8)]
        for i, r in enumerate(reqs):
            r.itl_target = itl_target[i % 2] if isinstance(itl_target, tuple) else itl_target
        widths = []
        while sim.sched.has_unfinished():
            sim.step()
            widths.append(len(sim.sched.running))
        return sim, reqs, widths

    sim, reqs, widths = crowd(itl_target=0.0125)
    assert max(widths) == 4 and widths[0] == 4
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, 6) for r in reqs)
    assert sim.kv.num_free_blocks == 64
    assert max(crowd(itl_target=0.020)[2]) == 7
    assert max(crowd(itl_target=(None, 0.0125))[2]) == 4  # one lane's objective binds the streams beside it too
    assert max(crowd()[2]) == 8
    assert max(crowd(itl_target=0.0125, itl_admission=False)[2]) == 8
    alone = Sim(64, 4, cost_model=FakeCost(base=0.020), max_num_batched_tokens=64)
    for rid, last in (("a", 7), ("b", 8)):
        alone.add(rid, [5, 6, last], 2).itl_target = 0.0125
    assert [len(o.chunks) for o in (alone.step(), alone.step(), alone.step())] == [1, 1, 1]  # one at a time
    alone.run()


def test_without_a_target_the_share_is_the_budget():
    sim = Sim(64, 4, cost_model=FakeCost(), max_num_batched_tokens=16, target_step_ms=None)
    sim.add("chat", [5, 6, 7], 4)
    sim.step()
    sim.add("long", list(range(30, 70)), 1)
    out = sim.step()
    assert chunks(out) == [("chat", 3, 1), ("long", 0, 15)] and out.target_time is None  # as before this rule
    assert out.prefill_budget == 15


def test_prefill_cap_binds_a_stream_resuming_from_the_cache():
    """Regression (TestSchedulerMachine, hypothesis seeds 1 and 2): a preempted stream whose KV stayed in the
    prefix cache is readmitted from the waiting queue straight into its decode; the step then carries a decode,
    so the prompt chunk admitted after it gets the cap, not what the budget leaves."""
    sim = Sim(6, 4, max_num_batched_tokens=9, max_num_seqs=2, max_model_len=24, max_prefill_tokens_while_decoding=1)
    a = sim.add("a", [3] * 11, 3)
    assert chunks(sim.step()) == [("a", 0, 9)]
    b = sim.add("b", [3, 3, 3, 4, 3, 3, 3, 3], 2)
    assert chunks(sim.step()) == [("a", 9, 2), ("b", 0, 7)]  # nothing decodes yet: no cap
    assert chunks(sim.step()) == [("a", 11, 1), ("b", 7, 1)]  # a decodes: b's chunk is capped at 1
    out = sim.step()  # a needs its fourth block: b (latest) goes; its two full blocks stay cached
    assert chunks(out) == [("a", 12, 1)] and out.preempted == [b] and a.is_finished
    c = sim.add("c", [3, 3], 1)
    out = sim.step()  # b resumes at its sampled token (a decode); c gets 1 prompt token beside it, not 2
    assert chunks(out) == [("b", 8, 1), ("c", 0, 1)] and [ch.is_decode for ch in out.chunks] == [True, False]
    assert chunks(sim.step()) == [("c", 1, 1)]
    assert b.bill.recomputed_tokens == 0 and b.clock.decode_steps == 1 and c.bill.prefilled_tokens == 2
    assert sim.kv.num_free_blocks == 6


def test_stream_resuming_from_the_cache_waits_behind_a_prompt_over_the_cap():
    """The other order: prompt tokens already past the cap (a recompute, no decode running) come first in the
    waiting queue, so the cached stream behind it resumes a step later rather than break the cap."""
    sim = Sim(3, 4, max_num_batched_tokens=12, max_num_seqs=2, max_model_len=12, max_prefill_tokens_while_decoding=2,
              scheduling_policy="priority")
    sim.add("a", [4, 4, 3, 4, 3, 4], 4, priority=0)
    b = sim.add("b", [4, 4, 3, 4], 2, priority=2)
    assert chunks(sim.step()) == [("a", 0, 6), ("b", 0, 4)]
    out = sim.step()
    assert chunks(out) == [("a", 6, 1)] and out.preempted == [b]
    c = sim.add("c", [4, 4, 3, 4, 3, 4], 4, priority=1)
    assert chunks(sim.step()) == [("a", 7, 1), ("c", 4, 2)]  # c hits b's cached block; capped beside a
    out = sim.step()
    assert chunks(out) == [("a", 8, 1)] and out.preempted == [c]
    out = sim.step()  # c recomputes 3 tokens with no decode running; b (a decode) may not join them
    assert chunks(out) == [("c", 4, 3)] and ids(sim.sched.waiting) == ["b"]
    out = sim.step()
    assert chunks(out) == [("c", 7, 1), ("b", 4, 1)] and all(ch.is_decode for ch in out.chunks)
    sim.run()
    assert b.bill.recomputed_tokens == 0 and c.bill.recomputed_tokens == 2 and sim.kv.num_free_blocks == 3


def test_max_num_seqs_and_queue_time():
    sim = Sim(32, 4, max_num_batched_tokens=64, max_num_seqs=2)
    a, b, c = (sim.add(r, [r_i + 3, r_i + 4], 3) for r_i, r in enumerate("abc"))
    assert chunks(sim.step()) == [("a", 0, 2), ("b", 0, 2)]
    assert ids(sim.sched.waiting) == ["c"] and len(sim.sched.running) == 2
    assert chunks(sim.step()) == [("a", 2, 1), ("b", 2, 1)]
    assert chunks(sim.step()) == [("a", 3, 1), ("b", 3, 1)]
    assert a.is_finished and b.is_finished and c.status == RequestStatus.WAITING
    assert chunks(sim.step()) == [("c", 0, 2)]
    assert c.clock.queue_time == 4.0 and a.clock.queue_time == 1.0
    sim.run()
    assert c.output_token_ids == expected_output(c.prompt_token_ids, 3)


def test_unchunked_never_splits_a_prompt():
    # As LLMEngine does when chunking is off, the budget covers a whole max_model_len prompt.
    sim = Sim(64, 4, max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    sim.add("a", list(range(3, 8)), 4)
    sim.add("b", list(range(20, 32)), 2)
    sim.add("c", list(range(40, 47)), 2)
    assert chunks(sim.step()) == [("a", 0, 5)]  # b (12) does not fit in 11 and c may not pass it
    assert chunks(sim.step()) == [("a", 5, 1), ("b", 0, 12)]  # c (7) does not fit in 3
    assert chunks(sim.step()) == [("a", 6, 1), ("b", 12, 1), ("c", 0, 7)]
    sim.run()
    for out in sim.outputs:
        for ch in out.chunks:
            if not ch.is_decode:
                assert ch.samples, f"prompt split: {ch}"

    chunked = Sim(64, 4, max_num_batched_tokens=16)
    chunked.add("a", list(range(3, 8)), 4)
    chunked.add("b", list(range(20, 32)), 2)
    assert chunks(chunked.step()) == [("a", 0, 5), ("b", 0, 11)]


def test_unchunked_admits_a_prompt_that_exactly_fills_the_room():
    sim = Sim(64, 4, max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    sim.add("a", [3, 4, 5, 6], 3)
    sim.add("b", list(range(20, 32)), 2)
    sim.add("c", list(range(40, 54)), 1)
    assert chunks(sim.step()) == [("a", 0, 4), ("b", 0, 12)]  # 4 + 12 = the whole budget
    assert chunks(sim.step()) == [("a", 4, 1), ("b", 12, 1), ("c", 0, 14)]  # two decodes + 14 = 16
    assert chunks(sim.step()) == [("a", 5, 1)]
    assert all(o.num_tokens == 16 for o in sim.outputs[:2])


def test_a_preemption_gives_its_budget_back_to_the_step():
    """Priority: v (priority 3) decodes first in the running order; d (priority 0) then needs a block and
    preempts v, whose token is handed back, so p's prompt chunk gets 3 tokens, not 2."""
    sim = Sim(5, 2, caching=False, max_num_batched_tokens=4, max_num_seqs=3, scheduling_policy="priority")
    v = sim.add("v", [9, 6, 5, 4, 5], 3, priority=3)
    assert chunks(sim.step()) == [("v", 0, 4)]
    sim.add("p", [9, 7, 3, 4], 5, priority=1)
    sim.add("d", [7, 6], 3, priority=0)
    assert chunks(sim.step()) == [("v", 4, 1), ("d", 0, 2), ("p", 0, 1)] and sim.kv.num_free_blocks == 0
    out = sim.step()
    assert out.preempted == [v] and chunks(out) == [("d", 2, 1), ("p", 1, 3)] and out.num_tokens == 4
    sim.run()
    assert v.num_preemptions == 2 and sim.kv.num_free_blocks == 5
    for r in sim.reqs.values():
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)


def _three_decoders(policy: str = "fcfs", priorities=(0, 0, 0)) -> Sim:
    """a, b, c with 4-token prompts on a 6-block pool of 4 tokens (no prefix caching): each holds 2
    blocks after their first decode; whoever crosses position 8 first forces a preemption."""
    sim = Sim(6, 4, caching=False, max_num_batched_tokens=64, max_num_seqs=3, scheduling_policy=policy)
    sim.add("a", [11, 12, 13, 14], 8, priorities[0])
    sim.add("b", [21, 22, 23, 24], 10, priorities[1])
    sim.add("c", [31, 32, 33, 34], 6, priorities[2])
    sim.add("d", [41, 42], 2, 0)  # waits for a seat (max_num_seqs=3)
    return sim


def test_fcfs_preempts_latest_and_it_recomputes_first():
    sim = _three_decoders()
    a, b, c, d = (sim.reqs[r] for r in "abcd")
    assert chunks(sim.step()) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]
    for pos in range(4, 8):  # steps 2..5: one block each more, then decodes inside it
        assert chunks(sim.step()) == [("a", pos, 1), ("b", pos, 1), ("c", pos, 1)]
    assert sim.kv.num_free_blocks == 0

    out = sim.step()  # step 6: a needs a third block; c (latest arrival) goes
    assert chunks(out) == [("a", 8, 1), ("b", 8, 1)]
    assert out.preempted == [c]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.high_water == 8
    assert c.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert sim.kv.block_ids("c") == []
    assert ids(sim.sched.waiting) == ["c", "d"]  # back in front of the later arrival
    assert len(c.output_token_ids) == 5

    # a and b decode; c cannot be readmitted (9 tokens need 3 blocks, none free) and d may not pass it.
    assert chunks(sim.step()) == [("a", 9, 1), ("b", 9, 1)]
    assert chunks(sim.step()) == [("a", 10, 1), ("b", 10, 1)]
    assert a.is_finished and len(a.output_token_ids) == 8
    out = sim.step()  # step 9: a's 3 blocks are back; c recomputes all 9 tokens in one chunk
    assert chunks(out) == [("b", 11, 1), ("c", 0, 9)]  # d (1 block) does not fit beside them
    assert [ch.is_decode for ch in out.chunks] == [True, False]
    assert c.bill.recomputed_tokens == 8  # positions 0..7 had KV before; position 8 never had
    sim.run()
    for r in (a, b, c, d):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)
        assert r.bill.prompt_tokens == r.bill.cached_tokens + r.bill.prefilled_tokens
    assert c.bill.recomputed_tokens == 8 and c.bill.prefilled_tokens == 4 and c.bill.output_tokens == 6
    assert a.bill.recomputed_tokens == b.bill.recomputed_tokens == d.bill.recomputed_tokens == 0
    assert c.clock.decode_steps == c.max_output_tokens - 1 - 1  # one decode token went in the recompute chunk
    assert sim.computed["c"] == 8 + 9  # first life, then the recompute chunk that also sampled its last token
    assert sim.kv.num_free_blocks == 6


def test_priority_admits_lowest_value_first():
    sim = Sim(32, 4, max_num_batched_tokens=64, max_num_seqs=1, scheduling_policy="priority")
    for rid, prio in [("a", 5), ("b", 1), ("c", 3), ("d", 1)]:
        sim.add(rid, [3, 4, 5], 2, prio)
    assert ids(sim.sched.waiting) == ["b", "d", "c", "a"]
    sim.run()
    order = sorted(sim.reqs.values(), key=lambda r: r.clock.first_scheduled)
    assert ids(order) == ["b", "d", "c", "a"]


def test_priority_preempts_highest_value_not_latest():
    # b (priority 9) arrives first and runs alone; then a (0) and c (5). fcfs would preempt c.
    sim = Sim(6, 4, caching=False, max_num_batched_tokens=64, max_num_seqs=3, scheduling_policy="priority")
    b = sim.add("b", [21, 22, 23, 24], 10, 9)
    assert chunks(sim.step()) == [("b", 0, 4)]
    a = sim.add("a", [11, 12, 13, 14], 8, 0)
    c = sim.add("c", [31, 32, 33], 8, 5)
    assert chunks(sim.step()) == [("b", 4, 1), ("a", 0, 4), ("c", 0, 3)]
    preempted = []
    for _ in range(10):
        out = sim.step()
        preempted += out.preempted
        if preempted:
            break
    assert preempted == [b]
    assert ids(sim.sched.waiting) == ["b"]
    sim.run()
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert b.bill.recomputed_tokens > 0 and a.bill.recomputed_tokens == 0
    for r in (a, b, c):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)

    fcfs = Sim(6, 4, caching=False, max_num_batched_tokens=64, max_num_seqs=3)
    fb = fcfs.add("b", [21, 22, 23, 24], 10, 9)
    fcfs.step()
    fcfs.add("a", [11, 12, 13, 14], 8, 0)
    fc = fcfs.add("c", [31, 32, 33], 8, 5)
    first = next(o.preempted for o in iter(fcfs.step, None) if o.preempted)
    assert first == [fc] and fb.num_preemptions == 0


def test_preempted_request_rehits_its_own_cached_blocks():
    """With prefix caching a preempted request's full blocks stay cached (freed, not evicted), so
    readmission starts at its cached prefix: here nothing at all is recomputed. The hits sit in the
    free queue when touched; they must leave it, or the "new" block handed out is one of the hits."""
    sim = Sim(5, 4, caching=True, max_num_batched_tokens=64)
    a = sim.add("a", [11, 12, 13, 14], 6)
    c = sim.add("c", [31, 32, 33, 34], 8)
    for _ in range(5):
        sim.step()
    assert sim.kv.block_ids("a") == [0, 2] and sim.kv.block_ids("c") == [1, 3]
    out = sim.step()  # step 6: a takes the last free block; c cannot grow and preempts itself
    assert chunks(out) == [("a", 8, 1)] and out.preempted == [c]
    assert a.is_finished
    assert sim.kv.pool.free_block_ids == [3, 1, 4, 2, 0]  # c's blocks first (tail first), still cached
    out = sim.step()  # step 7: c's two full blocks are hits; only the never-computed position 8 runs
    assert chunks(out) == [("c", 8, 1)] and out.chunks[0].is_decode
    assert sim.kv.block_ids("c") == [1, 3, 4]
    assert c.bill.recomputed_tokens == 0 and c.bill.cached_tokens == 0 and c.num_preemptions == 1
    sim.run()
    assert c.output_token_ids == expected_output(c.prompt_token_ids, 8)
    assert c.clock.decode_steps == 7
    assert sim.kv.num_free_blocks == 5


def test_prefix_hits_add_up_over_requests():
    """The scheduler's hit counter sums every admission's cached tokens (two requests hit a's first block)."""
    sim = Sim(12, 4, max_num_batched_tokens=64)
    sim.add("a", list(range(3, 13)), 3)
    sim.step()
    sim.add("b", list(range(3, 9)), 2)
    sim.add("c", list(range(3, 10)), 2)
    sim.run()
    assert [sim.reqs[r].bill.cached_tokens for r in "abc"] == [0, 4, 4]
    assert (sim.sched.prefix_queries, sim.sched.prefix_hits) == (10 + 6 + 7, 8)


def test_abort_returns_blocks_at_once():
    sim = Sim(8, 4, max_num_batched_tokens=64)
    a = sim.add("a", list(range(3, 13)), 5)
    sim.step()
    b = sim.add("b", list(range(3, 9)), 5)
    assert chunks(sim.step()) == [("a", 10, 1), ("b", 4, 2)]  # b's first block is a hit on a's
    assert sim.kv.block_ids("b")[0] == sim.kv.block_ids("a")[0] and sim.kv.num_free_blocks == 4
    assert b.bill.cached_tokens == 4 and b.bill.prefilled_tokens == 2
    assert (sim.sched.prefix_queries, sim.sched.prefix_hits) == (10 + 6, 4)  # counted once, at first admission
    with pytest.raises(ValueError, match="^request id 'b' is already in use$"):
        sim.add("b", [1, 2], 1)
    sim.sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.clock.finished == sim.t
    assert sim.kv.block_ids("a") == [] and ids(sim.sched.running) == ["b"] and sim.kv.num_free_blocks == 6
    sim.run()
    assert b.status == RequestStatus.FINISHED_LENGTH and sim.kv.num_free_blocks == 8


# --- traces pinned step by step -----------------------------------------------
# Small workloads whose whole trace is fixed: each pins one rule that the mutation run (`make mutation`) found
# no other test holding. steps: per step, (chunks, preempted); requests: (decode_steps, interfered_steps,
# num_preemptions, cached_tokens, prefilled_tokens, recomputed_tokens).
TRACES = [
    pytest.param(  # a recompute chunk past the prompt that samples is not a decode (r0's decode_steps)
        {'block_size': 1,
         'max_model_len': 6,
         'max_num_batched_tokens': 4,
         'max_num_seqs': 4,
         'num_blocks': 6,
         'scheduling_policy': 'priority'},
        [('add', [5], 5, 3), ('add', [3], 5, 1)],
        [([('r1', 0, 1), ('r0', 0, 1)], []), ([('r1', 1, 1), ('r0', 1, 1)], []), ([('r1', 2, 1), ('r0', 2, 1)], []),
         ([('r1', 3, 1)], ['r0']), ([('r1', 4, 1)], []), ([('r0', 1, 3)], []), ([('r0', 4, 1)], [])],
        {'r0': (3, 0, 1, 0, 1, 2), 'r1': (4, 0, 0, 0, 1, 0)},
        1, id='recompute_past_the_prompt'),
    pytest.param(  # a budget of one token still decodes every step
        {'block_size': 1,
         'max_model_len': 8,
         'max_num_batched_tokens': 1,
         'max_num_seqs': 5,
         'max_prefill_tokens_while_decoding': 2,
         'num_blocks': 8},
        [('step',), ('add', [4, 3], 5, 2)],
        [([], []), ([('r0', 0, 1)], []), ([('r0', 1, 1)], []), ([('r0', 2, 1)], []), ([('r0', 3, 1)], []),
         ([('r0', 4, 1)], []), ([('r0', 5, 1)], [])],
        {'r0': (4, 0, 0, 0, 2, 0)},
        0, id='budget_of_one'),
    pytest.param(  # without chunking the cap does not apply: r1's whole prompt joins r0's decode
        {'block_size': 4,
         'caching': False,
         'enable_chunked_prefill': False,
         'max_model_len': 28,
         'max_num_batched_tokens': 28,
         'max_num_seqs': 3,
         'max_prefill_tokens_while_decoding': 5,
         'num_blocks': 7},
        [('add', [4, 3, 4, 4, 3], 4, 1), ('step',), ('step',), ('add', [6, 4, 4, 5, 3, 6, 4, 9], 3, 0)],
        [([('r0', 0, 5)], []), ([('r0', 5, 1)], []), ([('r0', 6, 1), ('r1', 0, 8)], []),
         ([('r0', 7, 1), ('r1', 8, 1)], []), ([('r1', 9, 1)], [])],
        {'r0': (3, 1, 0, 0, 5, 0), 'r1': (2, 0, 0, 0, 8, 0)},
        0, id='unchunked_ignores_the_cap'),
    pytest.param(  # a prompt chunk's allocation preempts (the prompts loop hands `out` on)
        {'block_size': 4,
         'max_model_len': 16,
         'max_num_batched_tokens': 3,
         'max_num_seqs': 2,
         'max_prefill_tokens_while_decoding': 1,
         'num_blocks': 4},
        [('add', [4, 4, 3, 3, 3], 8, 0), ('add', [4, 4, 3, 3, 3, 4], 6, 2)],
        [([('r0', 0, 3)], []), ([('r0', 3, 2), ('r1', 0, 1)], []), ([('r0', 5, 1), ('r1', 1, 1)], []),
         ([('r0', 6, 1), ('r1', 2, 1)], []), ([('r0', 7, 1), ('r1', 3, 1)], []), ([('r0', 8, 1)], ['r1']),
         ([('r0', 9, 1), ('r1', 4, 1)], []), ([('r0', 10, 1), ('r1', 5, 1)], []),
         ([('r0', 11, 1), ('r1', 6, 1)], []), ([('r1', 7, 1)], []), ([('r1', 8, 1)], []), ([('r1', 9, 1)], []),
         ([('r1', 10, 1)], [])],
        {'r0': (7, 5, 0, 0, 5, 0), 'r1': (5, 0, 1, 0, 6, 0)},
        1, id='prompt_chunk_preempts'),
    pytest.param(  # a running prompt chunk and the admissions after it share one cap
        {'block_size': 4,
         'max_model_len': 36,
         'max_num_batched_tokens': 4,
         'max_num_seqs': 5,
         'max_prefill_tokens_while_decoding': 1,
         'num_blocks': 9,
         'scheduling_policy': 'priority'},
        [('add', [4, 4, 3], 4, 1), ('add', [4, 4], 7, 0), ('add', [4, 4, 3, 4, 3, 3, 3, 4, 3, 3, 3, 3], 2, 3),
         ('step',)],
        [([('r1', 0, 2), ('r0', 0, 2)], []), ([('r1', 2, 1), ('r0', 2, 1)], []),
         ([('r1', 3, 1), ('r0', 3, 1), ('r2', 0, 1)], []), ([('r1', 4, 1), ('r0', 4, 1), ('r2', 1, 1)], []),
         ([('r1', 5, 1), ('r0', 5, 1), ('r2', 2, 1)], []), ([('r1', 6, 1), ('r2', 3, 1)], []),
         ([('r1', 7, 1), ('r2', 4, 1)], []), ([('r2', 5, 4)], []), ([('r2', 9, 3)], []), ([('r2', 12, 1)], [])],
        {'r0': (3, 3, 0, 0, 3, 0), 'r1': (6, 6, 0, 0, 2, 0), 'r2': (1, 0, 0, 0, 12, 0)},
        0, id='cap_shared_running_then_waiting'),
    pytest.param(  # admissions beside decodes share one cap
        {'block_size': 4,
         'max_model_len': 28,
         'max_num_batched_tokens': 8,
         'max_num_seqs': 5,
         'max_prefill_tokens_while_decoding': 1,
         'num_blocks': 7,
         'short_prompts_first': False},
        [('add', [4, 3, 4, 4, 4, 3, 3], 7, 2), ('add', [9, 9, 8], 6, 0),
         ('add', [3, 7, 5, 6, 9, 7, 6, 5, 3, 9, 3], 5, 3), ('add', [6], 2, 0)],
        [([('r0', 0, 7), ('r1', 0, 1)], []), ([('r0', 7, 1), ('r1', 1, 1)], []), ([('r0', 8, 1), ('r1', 2, 1)], []),
         ([('r0', 9, 1), ('r1', 3, 1), ('r2', 0, 1)], []), ([('r0', 10, 1), ('r1', 4, 1), ('r2', 1, 1)], []),
         ([('r0', 11, 1), ('r1', 5, 1), ('r2', 2, 1)], []), ([('r0', 12, 1), ('r1', 6, 1), ('r2', 3, 1)], []),
         ([('r1', 7, 1), ('r2', 4, 1)], []), ([('r2', 5, 6), ('r3', 0, 1)], []),
         ([('r2', 11, 1), ('r3', 1, 1)], []), ([('r2', 12, 1)], []), ([('r2', 13, 1)], []), ([('r2', 14, 1)], [])],
        {'r0': (6, 6, 0, 0, 7, 0), 'r1': (5, 5, 0, 0, 3, 0), 'r2': (4, 0, 0, 0, 11, 0), 'r3': (1, 0, 0, 0, 1, 0)},
        0, id='cap_shared_between_admissions'),
    pytest.param(  # each admission spends the step's budget
        {'block_size': 2,
         'max_model_len': 18,
         'max_num_batched_tokens': 4,
         'max_num_seqs': 4,
         'max_prefill_tokens_while_decoding': 3,
         'num_blocks': 9,
         'short_prompts_first': False},
        [('add', [3, 4, 4, 3, 3, 4, 3, 3, 4, 3, 4], 6, 3), ('add', [9], 3, 0), ('add', [3, 4], 5, 3),
         ('add', [8, 3, 9, 6, 4, 3, 5, 9, 5, 8], 6, 0), ('step',), ('step',)],
        [([('r0', 0, 4)], []), ([('r0', 4, 4)], []), ([('r0', 8, 3), ('r1', 0, 1)], []),
         ([('r0', 11, 1), ('r1', 1, 1), ('r2', 0, 2)], []), ([('r0', 12, 1), ('r1', 2, 1)], ['r2']),
         ([('r0', 13, 1), ('r2', 2, 1), ('r3', 0, 2)], []), ([('r0', 14, 1), ('r2', 3, 1)], ['r3']),
         ([('r0', 15, 1)], ['r2']), ([('r2', 4, 1), ('r3', 0, 3)], []), ([('r2', 5, 1), ('r3', 3, 3)], []),
         ([('r3', 6, 4)], []), ([('r3', 10, 1)], []), ([('r3', 11, 1)], []), ([('r3', 12, 1)], []),
         ([('r3', 13, 1)], []), ([('r3', 14, 1)], [])],
        {'r0': (5, 2, 0, 0, 11, 0), 'r1': (2, 1, 0, 0, 1, 0), 'r2': (4, 3, 2, 0, 2, 0), 'r3': (5, 0, 1, 0, 10, 2)},
        3, id='admissions_spend_the_budget'),
    pytest.param(  # a request that preempts itself takes no budget; an unscheduled victim gives none back
        {'block_size': 4,
         'caching': False,
         'max_model_len': 16,
         'max_num_batched_tokens': 9,
         'max_num_seqs': 3,
         'max_prefill_tokens_while_decoding': 1,
         'num_blocks': 4,
         'scheduling_policy': 'priority'},
        [('step',), ('add', [4, 9, 5, 6, 9, 4, 5, 8, 9, 7], 5, 1), ('step',),
         ('add', [3, 3, 3, 3, 3, 3, 4, 4, 4, 3, 4, 4], 2, 0)],
        [([], []), ([('r0', 0, 9)], []), ([('r0', 9, 1)], []), ([('r0', 10, 1), ('r1', 0, 1)], []),
         ([('r0', 11, 1), ('r1', 1, 1)], []), ([('r1', 2, 9)], ['r0']), ([('r1', 11, 1)], []),
         ([('r1', 12, 1)], []), ([('r0', 0, 9)], []), ([('r0', 9, 4)], []), ([('r0', 13, 1)], [])],
        {'r0': (3, 2, 1, 0, 10, 12), 'r1': (1, 0, 0, 0, 12, 0)},
        1, id='self_preemption_gives_back_nothing'),
    pytest.param(  # a one-token prefill chunk beside a decode counts as interference
        {'block_size': 1, 'max_model_len': 8, 'max_num_batched_tokens': 5, 'max_num_seqs': 2, 'num_blocks': 8},
        [('add', [4, 4], 2, 2), ('add', [4, 4, 3, 3], 3, 0)],
        [([('r0', 0, 2), ('r1', 0, 3)], []), ([('r0', 2, 1), ('r1', 3, 1)], []), ([('r1', 4, 1)], []),
         ([('r1', 5, 1)], [])],
        {'r0': (1, 1, 0, 0, 2, 0), 'r1': (2, 0, 0, 0, 4, 0)},
        0, id='one_prefill_token_interferes'),
    pytest.param(  # a recompute is a prompt chunk: capped beside decodes, never in the decode loop
        {'block_size': 1,
         'caching': False,
         'max_model_len': 8,
         'max_num_batched_tokens': 7,
         'max_num_seqs': 5,
         'max_prefill_tokens_while_decoding': 1,
         'num_blocks': 8,
         'scheduling_policy': 'priority'},
        [('add', [3, 4, 4, 4, 4], 3, 2), ('step',), ('add', [3, 4, 4, 4, 4], 1, 1), ('add', [5, 8], 6, 1)],
        [([('r0', 0, 5)], []), ([('r0', 5, 1), ('r1', 0, 1)], []), ([('r1', 1, 1)], ['r0']),
         ([('r1', 2, 3), ('r2', 0, 2)], []), ([('r2', 2, 1), ('r0', 0, 1)], []), ([('r2', 3, 1), ('r0', 1, 1)], []),
         ([('r2', 4, 1), ('r0', 2, 1)], []), ([('r2', 5, 1)], ['r0']), ([('r2', 6, 1), ('r0', 0, 1)], []),
         ([('r0', 1, 6)], [])],
        {'r0': (1, 1, 2, 0, 5, 9), 'r1': (0, 0, 0, 0, 5, 0), 'r2': (5, 4, 0, 0, 2, 0)},
        2, id='recompute_is_capped_beside_decodes'),
    pytest.param(  # a prefix hit at readmission adds to the first one's cached_tokens (r0: 4, not 0)
        {'block_size': 2,
         'max_model_len': 12,
         'max_num_batched_tokens': 3,
         'max_num_seqs': 4,
         'max_prefill_tokens_while_decoding': 5,
         'num_blocks': 6,
         'scheduling_policy': 'priority'},
        [('add', [4, 4, 4, 3, 3, 3, 3], 3, 3), ('add', [8, 9, 3, 5], 5, 2), ('add', [4, 4, 4, 3, 3], 6, 0)],
        [([('r2', 0, 3)], []), ([('r2', 3, 2), ('r1', 0, 1)], []), ([('r2', 5, 1), ('r1', 1, 2)], []),
         ([('r2', 6, 1), ('r1', 3, 1)], []), ([('r2', 7, 1)], ['r1']), ([('r2', 8, 1)], []), ([('r2', 9, 1)], []),
         ([('r1', 2, 3)], []), ([('r1', 5, 1), ('r0', 4, 2)], []), ([('r1', 6, 1)], ['r0']), ([('r1', 7, 1)], []),
         ([('r0', 4, 3)], []), ([('r0', 7, 1)], []), ([('r0', 8, 1)], [])],
        {'r0': (2, 0, 1, 4, 3, 2), 'r1': (3, 1, 1, 0, 4, 2), 'r2': (5, 2, 0, 0, 5, 0)},
        2, id='cache_hits_add_up'),
    pytest.param(  # a resuming stream joins when the prompt tokens already placed equal the cap
        {'block_size': 4,
         'max_model_len': 12,
         'max_num_batched_tokens': 12,
         'max_num_seqs': 3,
         'max_prefill_tokens_while_decoding': 3,
         'num_blocks': 3,
         'scheduling_policy': 'priority'},
        [('add', [4, 4, 3, 4, 3, 4], 4, 0), ('add', [4, 4, 3, 4], 2, 2), ('step',), ('step',),
         ('add', [4, 4, 3, 4, 3, 4], 4, 1), ('add', [7, 8, 9], 1, 3)],
        [([('r0', 0, 6), ('r1', 0, 4)], []), ([('r0', 6, 1)], ['r1']), ([('r0', 7, 1), ('r2', 4, 2)], []),
         ([('r0', 8, 1)], ['r2']), ([('r2', 4, 3), ('r1', 4, 1)], []), ([('r2', 7, 1), ('r3', 0, 3)], []),
         ([('r2', 8, 1)], [])],
        {'r0': (3, 1, 0, 0, 6, 0), 'r1': (1, 1, 1, 0, 4, 0), 'r2': (2, 1, 1, 4, 2, 2), 'r3': (0, 0, 0, 0, 3, 0)},
        2, id='resume_joins_at_exactly_the_cap'),
]


@pytest.mark.parametrize("args, ops, steps, requests, preemptions", TRACES)
def test_pinned_trace(args, ops, steps, requests, preemptions):
    args = dict(args)
    sim = Sim(args.pop("num_blocks"), args.pop("block_size"), args.pop("caching", True), **args)
    got = []
    for i, op in enumerate(ops):
        if op[0] == "add":
            sim.add(f"r{sum(o[0] == 'add' for o in ops[:i])}", *op[1:3], priority=op[3])
        else:
            out = sim.step()
            got.append((chunks(out), ids(out.preempted)))
    while sim.sched.has_unfinished() and len(got) < 4 * len(steps):
        out = sim.step()
        got.append((chunks(out), ids(out.preempted)))
    assert [tuple(map(list, g)) for g in got] == [tuple(map(list, s)) for s in steps]
    assert {r.request_id: (r.clock.decode_steps, r.clock.interfered_steps, r.num_preemptions, r.bill.cached_tokens,
                           r.bill.prefilled_tokens, r.bill.recomputed_tokens) for r in sim.reqs.values()} == requests
    assert sim.sched.num_preemptions == preemptions == sum(r.num_preemptions for r in sim.reqs.values())
    for r in sim.reqs.values():
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)
    # nothing is left behind: no request, arrival number or block
    assert not sim.sched.requests and not sim.sched._arrival_seq and sim.kv.num_free_blocks == sim.kv.num_blocks


# --- random operations -------------------------------------------------------

TOKENS = st.integers(3, 6)  # a small alphabet, so prefixes collide and blocks get shared


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds (prefix-sharing prompts, priorities), aborts and steps on tiny pools; every
    invariant checked after every rule, and at the end everything finishes and every block is free."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 14),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 5),
        chunked=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        bases=st.lists(st.lists(TOKENS, min_size=24, max_size=24), min_size=2, max_size=2),
        cap=st.one_of(st.none(), st.integers(1, 8)),
        target_ms=st.one_of(st.none(), st.floats(0.5, 40)),
        share=st.sampled_from([0.0, 0.5, 1.0]),
        prompt_share=st.sampled_from([0.0, 0.5, 0.9]),
        # a fixed cost profile (ms per step, per prompt token, per pair, per decode, per context token, per row)
        cost=st.one_of(st.none(), st.tuples(*(st.floats(0, hi) for hi in (5, 2, 0.05, 2, 0.1, 1)))),
        drafts=st.one_of(st.none(), st.integers(0, 2**16)),  # speculation's random drafts (and accept counts)
        gamma=st.integers(1, 4),
        short_first=st.booleans(),
    )
    def setup(self, block_size, num_blocks, budget, max_num_seqs, chunked, policy, caching, bases, cap, target_ms,
              share, prompt_share, cost, drafts, gamma, short_first):
        max_len = min(num_blocks * block_size, 40)  # LLMEngine clips max_model_len to the pool
        if not chunked:
            budget = max(budget, max_len)  # as LLMEngine does
        model = None if cost is None else LinearCostModel([c / 1e3 for c in cost], online=False)
        self.sim = Sim(num_blocks, block_size, caching, cost_model=model,
                       drafts=None if drafts is None else random.Random(drafts), gamma=gamma,
                       max_num_batched_tokens=budget,
                       max_num_seqs=max_num_seqs, max_model_len=max_len, enable_chunked_prefill=chunked,
                       scheduling_policy=policy, max_prefill_tokens_while_decoding=cap, target_step_ms=target_ms,
                       itl_objective_share=share, min_prompt_share=prompt_share, short_prompts_first=short_first)
        self.max_len = max_len
        self.bases = bases
        self.n = 0
        self.aborted: set[str] = set()
        self.preempted_seen: set[str] = set()
        self.clean = True  # False while a step or check runs: one that raised leaves it False for teardown

    @rule(base=st.integers(0, 1), prefix=st.integers(0, 24), suffix=st.lists(TOKENS, max_size=5),
          max_tokens=st.integers(1, 12), priority=st.integers(0, 3),
          itl_target=st.one_of(st.none(), st.just(math.inf), st.floats(1e-3, 0.05)))
    def add(self, base, prefix, suffix, max_tokens, priority, itl_target):
        prompt = (self.bases[base][:prefix] + suffix)[: self.max_len - 1]
        if not prompt:
            return
        max_out = min(max_tokens, self.max_len - len(prompt))  # LLMEngine.add_request's clipping
        self.sim.add(f"r{self.n}", prompt, max_out, priority).itl_target = itl_target
        self.n += 1

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.sim.sched.requests)
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        req = self.sim.sched.requests[rid]
        self.sim.sched.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(rid)
        assert self.sim.kv.block_ids(rid) == []

    @rule()
    def step(self):
        self._step()

    def _step(self):
        self.clean = False
        sched = self.sim.sched
        had_work = sched.has_unfinished()
        running_before = list(sched.running)
        out = self.sim.step()
        self.preempted_seen |= {r.request_id for r in out.preempted}
        cfg = self.sim.cfg
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert all(c.num_tokens >= 1 for c in out.chunks)
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        if had_work:
            assert out.chunks, "a step with unfinished requests scheduled nothing"
        # running requests first, then new admissions (none in a step that preempted)
        kinds = [c.request in running_before for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True)
        if out.preempted:
            assert all(kinds)
        if not cfg.enable_chunked_prefill:
            for c in out.chunks:
                assert c.samples, f"unchunked mode split {c}"
        for r in out.preempted:
            assert r not in [c.request for c in out.chunks]
        self.clean = True

    @invariant()
    def blocks_are_accounted(self):
        if not hasattr(self, "sim"):
            return
        self.clean = False
        kv, sched = self.sim.kv, self.sim.sched
        pool = kv.pool
        refs = Counter(b for rid in sched.requests for b in kv.block_ids(rid))
        assert set(kv._tables) <= set(sched.requests), "a finished request still holds blocks"
        assert [b.ref_cnt for b in pool.blocks] == [refs[i] for i in range(kv.num_blocks)]
        free = pool.free_block_ids
        assert len(free) == len(set(free))
        assert not any(pool.blocks[i].ref_cnt for i in free), "a referenced block is in the free queue"
        assert kv.num_free_blocks + len(refs) == kv.num_blocks, "leaked block"
        # no unverified token in the prefix cache: every cached block names a block of real tokens
        assert set(pool.cached_blocks) <= self.sim.real_hashes, "a block is cached under a draft token"
        self.clean = True

    @invariant()
    def requests_are_consistent(self):
        if not hasattr(self, "sim"):
            return
        self.clean = False
        sched, kv, bs = self.sim.sched, self.sim.kv, self.sim.bs
        assert set(sched.requests) == {r.request_id for r in sched.waiting + sched.running}
        assert len(sched.running) <= self.sim.cfg.max_num_seqs
        keys = [sched._order(r) for r in sched.waiting]
        assert keys == sorted(keys)
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0 and kv.block_ids(r.request_id) == []
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            assert 0 <= r.num_computed_tokens <= r.num_tokens
            table = kv.block_ids(r.request_id)
            assert len(table) == len(set(table))
            assert len(table) * bs >= r.num_computed_tokens
            # every computed position reads back the KV of this request's own prefix
            for p in range(r.num_computed_tokens):
                assert self.sim.slots[table[p // bs]][p % bs] == tuple(r.all_token_ids[: p + 1]), (r, p)
            parent = None
            for i, block_id in enumerate(table[: r.num_computed_tokens // bs]):
                parent = hash_block_tokens(parent, r.all_token_ids[i * bs : (i + 1) * bs])
                assert kv.pool.blocks[block_id].block_hash in (parent, None)
        for r in self.sim.reqs.values():
            # each prompt position is billed once, cached or prefilled; the split is complete with the prefill
            assert r.bill.cached_tokens + r.bill.prefilled_tokens <= r.bill.prompt_tokens
            if r.clock.prefill_done is not None:
                assert r.bill.prompt_tokens == r.bill.cached_tokens + r.bill.prefilled_tokens
            assert len(r.output_token_ids) <= r.max_output_tokens
            if r.bill.recomputed_tokens:
                assert r.num_preemptions > 0
        self.clean = True

    def teardown(self):
        # Hypothesis calls teardown after a failure too; draining a half-updated state would replace the
        # real failure with a confusing later one.
        if not hasattr(self, "sim") or not self.clean:
            return
        sim = self.sim
        bound = 50 * sum(r.num_prompt_tokens + r.max_output_tokens for r in sim.reqs.values()) + 20
        for _ in range(bound):
            if not sim.sched.has_unfinished():
                break
            self._step()
            self.blocks_are_accounted()
            self.requests_are_consistent()
        assert not sim.sched.has_unfinished(), f"livelock: {sim.sched.running} {sim.sched.waiting}"
        assert sim.kv.num_free_blocks == sim.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in sim.kv.pool.blocks)
        for rid, r in sim.reqs.items():
            assert r.is_finished
            if rid in self.aborted:
                continue
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)
            assert r.bill.output_tokens == r.max_output_tokens
            assert r.clock.first_scheduled <= r.clock.prefill_done <= r.clock.first_token <= r.clock.finished
            kept = sim.kept[rid]  # each kept draft is an output token without a decode step of its own
            assert r.clock.decode_steps + kept >= r.max_output_tokens - 1 - r.num_preemptions
            if r.num_preemptions == 0:
                assert r.bill.recomputed_tokens == 0
                assert sim.computed[rid] + kept == r.bill.prefilled_tokens + r.bill.output_tokens - 1
                assert r.clock.decode_steps + kept == r.max_output_tokens - 1
            else:
                # every computation is billed exactly once: first prefill, recompute, or decode (or a kept draft)
                billed = r.bill.prefilled_tokens + r.bill.recomputed_tokens + r.bill.output_tokens - 1
                assert sim.computed[rid] + kept == billed


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                               report_multiple_bugs=False)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_random_workload_many_preemptions():
    """A fixed random workload on a 10-block pool: many preemptions, all finish, nothing leaks."""
    import random

    rng = random.Random(0)
    sim = Sim(10, 2, max_num_batched_tokens=6, max_num_seqs=4)
    shared = [rng.randrange(3, 7) for _ in range(8)]
    for i in range(12):
        prompt = shared[: rng.randrange(0, 9)] + [rng.randrange(3, 7) for _ in range(rng.randrange(1, 5))]
        sim.add(f"r{i}", prompt, rng.randrange(1, 20 - len(prompt)))
    sim.run(2000)
    assert sim.sched.num_preemptions > 0
    assert sim.kv.num_free_blocks == 10
    for r in sim.reqs.values():
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)
        assert (r.bill.recomputed_tokens > 0) <= (r.num_preemptions > 0)


def test_drafts_get_slots_and_a_reject_rolls_back_by_counter():
    """One stream with two drafts, the first right, the second wrong: the verify chunk covers both drafts' slots,
    the right one becomes a computed token, the wrong one is never counted and its slot is simply reused."""
    sim = Sim(8, 4, max_num_batched_tokens=16)
    r = sim.add("a", [3, 4, 5], 8)
    sim.step()  # the prompt, and its first token
    seq = list(r.all_token_ids)
    right = fake_token(seq)
    r.spec_token_ids = [right, 3 + (fake_token(seq + [right]) - 3 + 1) % 50]
    out = sim.sched.schedule()
    (c,) = out.chunks
    assert (c.start, c.num_tokens, c.num_draft, c.samples, c.num_logits) == (3, 3, 2, True, 3)
    assert out.num_decode_tokens == 1 and out.num_draft_tokens == 2
    assert len(sim.kv.block_ids("a")) == 2  # positions 0..5: the drafts' slots reserved
    sim.sched.update_after_step(out, 1.0)
    assert r.num_computed_tokens == 4 and r.high_water == 4  # the drafts wait for commit_drafts
    sim.sample(r, r.spec_token_ids)
    assert r.output_token_ids[1:] == [right, fake_token(seq + [right])]
    assert r.num_computed_tokens == 5 and r.high_water == 5 and r.num_tokens == 6  # the wrong draft: not counted
    assert len(sim.kv.block_ids("a")) == 2  # nothing freed
    r.spec_token_ids = []


def test_drafts_beyond_the_budget_or_the_pool_are_cut_not_preempting():
    sim = Sim(2, 4, max_num_batched_tokens=3)
    r = sim.add("a", [3, 4, 5, 6, 7], 3)  # 5 prompt tokens: 2 blocks hold 8 positions
    while r.num_computed_tokens < 5:
        sim.step()
    r.spec_token_ids = [9, 9, 9, 9]
    out = sim.sched.schedule()
    (c,) = out.chunks
    assert c.num_draft == 2 and c.num_tokens == 3 and not out.preempted  # the budget of 3 tokens cut two drafts
    sim.sched.update_after_step(out, 1.0)
    r.spec_token_ids = []


def test_random_workload_with_drafts_and_preemptions():
    """Drafts with random accept counts on a 10-block pool: drafts kept and rejected, preemptions, every request
    finishes with the fake model's own tokens, nothing leaks, nothing unverified is cached."""
    rng = random.Random(1)
    sim = Sim(10, 2, max_num_batched_tokens=8, max_num_seqs=4, drafts=random.Random(2), gamma=3)
    shared = [rng.randrange(3, 7) for _ in range(8)]
    for i in range(12):
        prompt = shared[: rng.randrange(0, 9)] + [rng.randrange(3, 7) for _ in range(rng.randrange(1, 5))]
        sim.add(f"r{i}", prompt, rng.randrange(1, 20 - len(prompt)))
    sim.run(2000)
    drafted = sum(c.num_draft for out in sim.outputs for c in out.chunks)
    kept = sum(sim.kept.values())
    assert sim.sched.num_preemptions > 0 and 0 < kept < drafted
    assert sim.kv.num_free_blocks == 10
    assert set(sim.kv.pool.cached_blocks) <= sim.real_hashes
    for r in sim.reqs.values():
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_output_tokens)
