"""Seed the step cost model: a roofline guess from the model's shape, then a few real steps at start-up.

`roofline_prior` turns parameter counts and a nominal machine (FLOP/s, bytes/s per device kind) into the six
coefficients of engine/cost_model.py: a starting point the online fit corrects within a few dozen steps.
`probe` then times a handful of steps of the real model on scratch KV blocks (a prompt chunk alone, decodes
alone at two batch sizes, a chunk beside decodes, a whole short prompt; ~290 prompt tokens in all), after two
unobserved warm-up steps (one as wide as the scheduler's token budget through the first layer, one small), and
feeds them to the model: under a second on a CPU for the ~100M benchmark Llama (twice the demo model's size), a few
milliseconds for the tests' tiny checkpoints. The blocks
go back to the pool unhashed, so the prefix cache never sees the probe's garbage tokens; nothing else in the
engine is touched. Sizes shrink to fit small pools and short max_model_len; where even the smallest step does
not fit, the probe is skipped and the prior stands.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from twospeed.config import ModelConfig
from twospeed.engine.cost_model import LinearCostModel, StepShape
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.engine.request import Request
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.scheduler import ScheduledChunk

# Nominal (FLOP/s, bytes/s) by device kind for the prior; deliberately modest, the fit corrects them.
NOMINAL = {"cpu": (1e11, 2e10), "cuda": (1e14, 1.5e12)}


def roofline_prior(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> list[float]:
    """Coefficients (FEATURES order) from the model's shape and a nominal machine."""
    flops, bandwidth = NOMINAL.get(device.type, NOMINAL["cpu"])
    elem = torch.empty((), dtype=dtype).element_size()
    embed = cfg.vocab_size * cfg.hidden_size
    body = cfg.num_params - embed * (1 if cfg.tie_word_embeddings else 2)
    per_token = 2 * body / flops
    per_pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim / flops  # QK^T and PV, 2 FLOP a multiply-add
    kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    return [1e-3 + (body + embed) * elem / bandwidth,  # every weight read once, plus per-step dispatch
            per_token, per_pair, 2 * per_token,  # a decode row: small-M linears run below peak
            kv_bytes / bandwidth, 2 * embed / flops]


def probe(runner, kv: KVCacheManager, sampler, model: LinearCostModel, max_len: int, widest: int = 0) -> int:
    """Time a few real steps on scratch blocks and `observe` them; returns the steps observed (0 if skipped).
    widest: the scheduler's token budget. One step that wide runs first, unobserved, as vLLM's start-up profile run
    does: the first step of a shape pays what no later one does (the allocator's first large buffers and their page
    faults, new kernel shapes). On the ~100M Llama a fresh server's first 2,047-token step took 1,137 ms against a
    prediction of 167, and stalled the stream decoding beside it. That step runs through the first decoder layer
    only (`first_layer_only`): every layer has the same shapes and frees its buffers before the next one allocates
    them, so one layer meets every first-call cost, at a fraction of a full step's arithmetic (on a CPU without a
    fast GEMM the full step was most of a server's start-up). Observing a second run taught the fit worse, not
    better: one point that wide outweighed the short chunks the scheduler sizes (median error 8.4% -> 10.0%, p99
    0.62 -> 3.23 in the same benchmark), so the online fit learns wide steps from serving."""
    bs = kv.block_size
    room_tokens = kv.num_free_blocks * bs
    # the full-size plan needs ~1300 tokens of KV (8 decodes at 128 + two prompts) and positions up to 192
    f = min(1.0, (max_len - 1) / 192, room_tokens / 1400)
    size = lambda n: max(1, int(n * f))  # noqa: E731
    if f < 0.05:
        return 0
    ids = iter(range(10 ** 9))
    made: list[str] = []
    vocab = runner.model.cfg.vocab_size  # the probe's token ids stay inside it (a test model may have 5 tokens)

    def request(ctx: int, extra: int, decoding: bool) -> Request:
        rid = f"cost-probe-{next(ids)}"
        req = Request(rid, [(3 + i % 97) % vocab for i in range(ctx + extra)], SamplingParams(max_tokens=1),
                      max_output_tokens=1)
        if not kv.allocate_slots(rid, ctx + extra + 1):
            raise _PoolFull
        made.append(rid)
        if decoding:  # its prompt is "computed" (the KV read is whatever the blocks hold) and one token sampled
            req.append_token(5 % vocab, 0.0)
            req.num_computed_tokens = req.high_water = req.num_tokens - 1
        return req

    def run(chunks: list[ScheduledChunk], observe: bool = True) -> None:
        start = time.perf_counter()
        logits, sampling, _ = runner.execute(chunks, kv)
        if sampling:
            sampler(logits, [c.request for c in sampling])
        if observe:
            model.observe(StepShape.from_chunks(chunks), time.perf_counter() - start)

    try:
        wide = min(widest, max_len - 1, kv.num_free_blocks * bs - 2 * bs)
        if wide > size(192):
            first = request(0, wide, decoding=False)
            with first_layer_only(runner.model):
                run([ScheduledChunk(first, 0, wide)], observe=False)
            kv.free(first.request_id)
            made.remove(first.request_id)
        long = request(0, size(192), decoding=False)
        run([ScheduledChunk(long, 0, size(32))], observe=False)  # warm-up: first-call allocations
        run([ScheduledChunk(long, size(32), size(96))])  # a chunk continuing a prompt
        one = request(size(64) - 1, 1, decoding=True)
        run([ScheduledChunk(one, one.num_computed_tokens, 1)])
        streams = [request(size(128) - 1, 1, decoding=True) for _ in range(8)]
        decodes = [ScheduledChunk(r, r.num_computed_tokens, 1) for r in streams]
        run(decodes)
        run(decodes + [ScheduledChunk(long, size(128), size(64))])  # a chunk beside decodes
        fresh = request(0, size(128), decoding=False)
        run([ScheduledChunk(fresh, 0, size(128))])  # a whole short prompt, sampled
        run(decodes[:4] + [ScheduledChunk(one, one.num_computed_tokens, 1)])
    except _PoolFull:
        pass
    finally:
        for rid in made:
            kv.free(rid)
    model.clear_errors()  # the prior's misses while the probe taught it say nothing about serving
    return model.num_observed


@contextmanager
def first_layer_only(model: torch.nn.Module):
    """The model runs its first decoder layer alone (then its final norm and head) until the block ends."""
    layers = model.layers
    model.layers = torch.nn.ModuleList(layers[:1])
    try:
        yield
    finally:
        model.layers = layers


class _PoolFull(Exception):
    """The pool cannot hold the probe's next request (a tiny pool): stop there."""
