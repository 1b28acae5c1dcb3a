"""The split clock and the split bill on a real (tiny) checkpoint, and the step stats that sum to them.

Clock: every timestamp in lifecycle order, the derived numbers exactly as docs/ARCHITECTURE.md defines them,
chunked prefill stretching a long prompt over several steps while short requests decode beside it.
Bill: prompt = cached + prefilled, block-aligned prefix hits, recompute only after a preemption,
and the per-step token counts in `engine.last_stats` adding up to the per-request bills.
"""

from __future__ import annotations

import random

import pytest

from conftest import write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.engine.request import Request

BS = 4
VOCAB = 301  # conftest's llama


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(path, "llama")
    return str(path)


def make_llm(ckpt, **kw) -> LLM:
    return LLM(ckpt, skip_tokenizer_init=True, **{"block_size": BS, "num_gpu_blocks": 128, **kw})


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def drive(llm: LLM, prompts, max_tokens, **add_kw) -> tuple[list[Request], list]:
    """Add every prompt, step until all finish; returns the Request objects and each step's StepStats."""
    engine = llm.engine
    reqs = [engine.add_request(None, p, params(n), **add_kw) for p, n in zip(prompts, max_tokens)]
    stats = []
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        stats.append(engine.last_stats)
    assert all(r.is_finished for r in reqs)
    return reqs, stats


# --- clock -------------------------------------------------------------------


def test_timestamps_in_lifecycle_order_and_derived_fields(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=16)
    rng = random.Random(0)
    lengths, max_tokens = [1, 5, 17, 30, 9], [1, 6, 9, 4, 2]
    reqs, stats = drive(llm, [rand_prompt(rng, n) for n in lengths], max_tokens)
    longest_step = max(s.step_time for s in stats)
    for r, n in zip(reqs, max_tokens):
        c = r.clock
        chain = [c.arrival, c.first_scheduled, c.prefill_done, c.first_token, *c.token_times, c.finished]
        assert None not in chain
        assert chain == sorted(chain), f"{r}: timestamps out of order {chain}"
        assert c.first_token == c.token_times[0]
        assert len(c.token_times) == r.bill.output_tokens == n

        assert c.queue_time == c.first_scheduled - c.arrival >= 0
        assert c.prefill_time == c.prefill_done - c.first_scheduled >= 0
        first_sample = c.first_token - c.prefill_done
        assert 0 <= first_sample <= longest_step  # the sampler's share of the prefill's last step
        assert c.ttft == pytest.approx(c.queue_time + c.prefill_time + first_sample, abs=1e-9)
        assert c.ttlt == c.finished - c.arrival >= c.ttft

        assert len(c.itl) == n - 1
        assert all(g >= 0 for g in c.itl)
        assert sum(c.itl) == pytest.approx(c.token_times[-1] - c.first_token, abs=1e-9)
        if n == 1:
            assert c.tpot is None
        else:
            assert c.tpot == pytest.approx((c.ttlt - c.ttft) / (n - 1), abs=1e-12)
            assert c.tpot * (n - 1) >= sum(c.itl) - 1e-9
        assert c.decode_steps == n - 1  # no preemption here: one decode step per later token
        summary = c.summary()
        assert summary["ttft"] == c.ttft and summary["tpot"] == c.tpot and summary["queue_time"] == c.queue_time
        if c.itl:
            assert summary["itl_max"] == max(c.itl)
            assert min(c.itl) <= summary["itl_p50"] <= summary["itl_p99"] <= summary["itl_max"]


def test_chunked_prefill_spans_steps_while_short_requests_decode(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=8)
    engine = llm.engine
    rng = random.Random(1)
    shorts = [engine.add_request(None, rand_prompt(rng, 3), params(12)) for _ in range(2)]
    long = engine.add_request(None, rand_prompt(rng, 60), params(2))
    prefill_steps = 0
    interfered = {r.request_id: 0 for r in shorts}
    longest = {r.request_id: 0.0 for r in shorts}
    while engine.has_unfinished_requests():
        computed = long.num_computed_tokens
        decode_steps = {r.request_id: r.clock.decode_steps for r in shorts}
        engine.step()
        stats = engine.last_stats
        if computed < long.num_prompt_tokens and long.num_computed_tokens > computed:
            prefill_steps += 1
        for r in shorts:
            if r.clock.decode_steps > decode_steps[r.request_id] and stats.num_prefill_tokens > 0:
                interfered[r.request_id] += 1
                longest[r.request_id] = max(longest[r.request_id], stats.step_time)
        assert stats.num_prefill_tokens + stats.num_decode_tokens <= 8

    assert prefill_steps >= 60 // 8  # budget 8, minus the decodes that went first
    assert long.clock.prefill_time > 0
    for r in shorts:
        assert r.clock.first_token < long.clock.prefill_done  # they streamed while the long prompt prefilled
        assert r.clock.token_times[1] < long.clock.prefill_done
        assert r.clock.decode_steps == 11
        assert r.clock.interfered_steps == interfered[r.request_id] > 0
        assert r.clock.interfered_steps >= prefill_steps - 1  # every later chunk step shared the batch
        assert r.clock.longest_interfered_step == longest[r.request_id] > 0  # the longest of those steps
    assert long.clock.decode_steps == 1 and long.clock.interfered_steps == 0
    assert long.clock.longest_interfered_step == 0.0


def test_queue_time_when_waiting_for_a_seat(ckpt):
    llm = make_llm(ckpt, max_num_seqs=1)
    rng = random.Random(2)
    (first, second), _ = drive(llm, [rand_prompt(rng, 6), rand_prompt(rng, 6)], [5, 5])
    assert first.clock.queue_time < second.clock.queue_time
    assert second.clock.first_scheduled >= first.clock.finished  # it had to wait for the seat
    assert second.clock.queue_time >= first.clock.finished - second.clock.arrival > 0
    assert second.clock.ttft > second.clock.queue_time


# --- bill --------------------------------------------------------------------


def check_bill(r: Request) -> None:
    b = r.bill
    assert b.prompt_tokens == len(r.prompt_token_ids) == b.cached_tokens + b.prefilled_tokens
    assert b.output_tokens == len(r.output_token_ids)
    if b.recomputed_tokens:
        assert r.num_preemptions > 0


def test_full_repeat_hits_block_aligned_prefix(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=16)
    rng = random.Random(3)
    prompts = [rand_prompt(rng, n) for n in (1, 3, 4, 5, 9, 16, 17)]
    cold, _ = drive(llm, prompts, [3] * len(prompts))
    warm, _ = drive(llm, prompts, [3] * len(prompts))
    for p, c, w in zip(prompts, cold, warm):
        check_bill(c)
        check_bill(w)
        assert c.bill.cached_tokens == 0
        assert w.bill.cached_tokens == (len(p) - 1) // BS * BS, f"prompt of {len(p)}"
        assert w.output_token_ids == c.output_token_ids

    off = make_llm(ckpt, max_num_batched_tokens=16, enable_prefix_caching=False)
    drive(off, prompts, [3] * len(prompts))
    again, _ = drive(off, prompts, [3] * len(prompts))
    for w in again:
        check_bill(w)
        assert w.bill.cached_tokens == 0 and w.bill.prefilled_tokens == w.bill.prompt_tokens


@pytest.mark.parametrize("k", [0, 3, 4, 8, 10, 13, 16])
def test_shared_prefix_hits_its_full_blocks(ckpt, k):
    rng = random.Random(10 + k)
    shared = rand_prompt(rng, k)
    a = shared + rand_prompt(rng, 7)
    b = shared + [3 + (a[k] - 3 + 1) % (VOCAB - 3)] + rand_prompt(rng, 5)  # diverges at token k
    assert b[k] != a[k]
    llm = make_llm(ckpt)
    (ra,), _ = drive(llm, [a], [4])
    (rb,), _ = drive(llm, [b], [4])
    check_bill(rb)
    assert rb.bill.cached_tokens == min(k // BS * BS, (len(b) - 1) // BS * BS)
    (rp,), _ = drive(llm, [a[:k + 1]], [2])  # a prefix of a, one past the shared part
    check_bill(rp)
    assert rp.bill.cached_tokens == k // BS * BS
    sched = llm.engine.scheduler  # the scheduler's prefix counters are the bills' sums
    assert sched.prefix_queries == sum(r.bill.prompt_tokens for r in (ra, rb, rp))
    assert sched.prefix_hits == sum(r.bill.cached_tokens for r in (ra, rb, rp))


def test_recompute_only_after_preemption(ckpt):
    rng = random.Random(4)
    prompts = [rand_prompt(rng, n) for n in (9, 14, 5, 21, 12, 7)]
    max_tokens = [12, 10, 14, 6, 11, 9]
    ref, _ = drive(make_llm(ckpt), prompts, max_tokens)
    for caching in (False, True):
        llm = make_llm(ckpt, num_gpu_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=caching)
        reqs, _ = drive(llm, prompts, max_tokens)
        assert llm.engine.scheduler.num_preemptions > 0
        for r, e in zip(reqs, ref):
            check_bill(r)
            assert r.output_token_ids == e.output_token_ids
            if not caching:  # nothing cached: a preempted request always recomputes something
                assert (r.bill.recomputed_tokens > 0) == (r.num_preemptions > 0)
        assert llm.engine.kv.num_free_blocks == 12
    for e in ref:
        assert e.num_preemptions == 0 and e.bill.recomputed_tokens == 0


# --- step stats sum to the bills ---------------------------------------------
#
# Each step computes num_prefill_tokens + num_decode_tokens tokens (StepStats). A request that
# finishes normally ends with num_computed_tokens = prompt + output - 1 (its last token is sampled,
# never computed); it started computing at its first prefix hit (cached_tokens), and every token it
# computed again after a preemption is counted in recomputed_tokens. So, when no readmission finds
# cached blocks past what the request itself had computed (true here: prompts share nothing):
#     sum over steps (prefill + decode) == sum over requests (prefilled + recomputed + output - 1)
# and without preemption the two halves match separately:
#     sum prefill == sum prefilled, sum decode == sum (output - 1) == sum decode_steps.


def test_step_stats_sum_to_bills_without_preemption(ckpt):
    rng = random.Random(5)
    shared = rand_prompt(rng, 13)
    prompts = [rand_prompt(rng, n) for n in (2, 11, 26)] + [shared + rand_prompt(rng, n) for n in (1, 6, 9)]
    max_tokens = [7, 3, 5, 8, 1, 6]
    llm = make_llm(ckpt, max_num_batched_tokens=10)
    drive(llm, prompts[:4], max_tokens[:4])  # the shared prefix is cached for the next batch
    reqs, stats = drive(llm, prompts, max_tokens)
    assert sum(r.bill.cached_tokens for r in reqs) > 0
    assert sum(s.num_prefill_tokens for s in stats) == sum(r.bill.prefilled_tokens for r in reqs)
    assert sum(s.num_decode_tokens for s in stats) == sum(r.bill.output_tokens - 1 for r in reqs)
    assert sum(s.num_decode_tokens for s in stats) == sum(r.clock.decode_steps for r in reqs)
    assert all(s.num_preempted == 0 for s in stats)
    for r in reqs:
        check_bill(r)


def test_step_stats_sum_to_bills_with_preemption(ckpt):
    rng = random.Random(6)
    prompts = [rand_prompt(rng, n) for n in (9, 14, 5, 21, 12, 7, 17)]
    max_tokens = [12, 10, 14, 6, 11, 9, 8]
    llm = make_llm(ckpt, num_gpu_blocks=12, max_num_batched_tokens=12)
    reqs, stats = drive(llm, prompts, max_tokens)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert sum(s.num_preempted for s in stats) == sched.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert any(r.bill.recomputed_tokens > 0 for r in reqs)
    computed = sum(s.num_prefill_tokens + s.num_decode_tokens for s in stats)
    billed = sum(r.bill.prefilled_tokens + r.bill.recomputed_tokens + r.bill.output_tokens - 1 for r in reqs)
    assert computed == billed
    assert sum(s.num_decode_tokens for s in stats) == sum(r.clock.decode_steps for r in reqs)
    for s in stats:
        assert s.num_prefill_tokens + s.num_decode_tokens <= 12
        assert 0 <= s.kv_blocks_used <= s.kv_blocks_total == 12
    assert stats[-1].kv_blocks_used == 0 and stats[-1].num_running == stats[-1].num_waiting == 0
    for r in reqs:
        check_bill(r)
