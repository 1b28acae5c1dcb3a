"""The CPU decode kernel (csrc/paged_attention.c) against the portable TorchPagedAttention on the same
paged cache: scattered block tables, padded groups, partial blocks, GQA ratios, sliding windows, both dtypes."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import needs_kernel
from twospeed.model.attention import (AttentionMetadata, DecodeGroup, PrefillBatch, PrefillSpan, TorchPagedAttention,
                                      causal_mask, decode_mask)
from twospeed.model.cbuild import unsupported_reason
from twospeed.model.cpu_attention import CpuPagedAttention, load_kernel, load_bf16_kernel, make_attention

pytestmark = needs_kernel(load_kernel, "paged_attention")


def decode_batch(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 window: int | None, dtype: torch.dtype, seed: int):
    """A random pool, one scattered block table per sequence, padded to the longest, and each decode's new K/V."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in need]
    width = max(need)
    n = len(lens)
    slots = [t[(m - 1) // block_size] * block_size + (m - 1) % block_size for t, m in zip(tables, lens)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=n)
    meta.decodes.append(DecodeGroup(
        start=0, num_tokens=n, block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        mask=decode_mask(lens, width * block_size, window, torch.device("cpu")), seq_lens=torch.tensor(lens)))
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, meta


CASES = [  # lens, heads, kv_heads, head_dim, block_size, window
    ([1], 4, 4, 8, 16, None),
    ([17, 3, 64, 65, 200], 12, 4, 64, 16, None),
    ([5, 40, 33], 6, 1, 12, 8, None),  # MQA, odd head_dim
    ([100, 31], 16, 1, 128, 32, None),  # G = 16, the kernel's limit
    ([90, 7, 129], 8, 2, 10, 16, 20),  # sliding window inside and beyond the context
    ([300], 4, 2, 256, 64, None),  # head_dim and block_size at the limits
    ([1500], 8, 2, 64, 16, None),  # few tasks, a long context: split into chunks merged after (AVX2 float32)
    ([1000, 600, 9], 6, 1, 40, 16, 300),  # split chunks inside a sliding window; head_dim 40: 8-column tail
]


@pytest.mark.parametrize("dtype,avx512_bf16", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_portable_decode(case, dtype, avx512_bf16):
    lens, heads, kv_heads, head_dim, block_size, window = CASES[case]
    args = decode_batch(lens, heads, kv_heads, head_dim, block_size, window, dtype, seed=case)
    ref_cache = [t.clone() for t in args[3:5]]
    expected = TorchPagedAttention(heads, kv_heads, head_dim).forward(*args[:3], *ref_cache, args[5])
    attn = CpuPagedAttention(heads, kv_heads, head_dim, window)
    if avx512_bf16 and attn.bf16_kernel is None:
        pytest.skip(f"kernel attention_bf16 unsupported here: {unsupported_reason('attention_bf16')}")
    if not avx512_bf16:
        attn.bf16_kernel = None  # the portable C kernel (csrc/paged_attention.c)
    got = attn.forward(*args)
    assert torch.equal(args[3], ref_cache[0]) and torch.equal(args[4], ref_cache[1])  # the same cache writes
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tol)


def test_mixed_batch_prefill_goes_through_the_portable_path():
    q, k, v, k_cache, v_cache, meta = decode_batch([9, 30], 4, 2, 16, 16, None, torch.float32, seed=7)
    # one prefill chunk of 5 tokens continuing a 20-token context held in blocks 1 and 2
    qp, kp, vp = (torch.randn(5, h, 16) for h in (4, 2, 2))
    meta.prefills.append(PrefillSpan(start=2, num_tokens=5, context_len=25, block_table=torch.tensor([1, 2]),
                                     mask=torch.ones(5, 25, dtype=torch.bool).tril(20)))
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.arange(20, 25) + 16])
    q, k, v = torch.cat([q, qp]), torch.cat([k, kp]), torch.cat([v, vp])
    ref_cache = [k_cache.clone(), v_cache.clone()]
    expected = TorchPagedAttention(4, 2, 16).forward(q, k, v, *ref_cache, meta)
    got = CpuPagedAttention(4, 2, 16).forward(q, k, v, k_cache, v_cache, meta)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_backend_choice():
    assert isinstance(make_attention("auto", 8, 2, 64, None, "cpu", torch.bfloat16), CpuPagedAttention)
    assert type(make_attention("torch", 8, 2, 64, None, "cpu", torch.bfloat16)) is TorchPagedAttention
    assert type(make_attention("auto", 8, 2, 64, None, "cpu", torch.float16)) is TorchPagedAttention
    assert type(make_attention("auto", 64, 2, 64, None, "cpu", torch.float32)) is TorchPagedAttention  # G = 32
    with pytest.raises(ValueError, match="attention_backend 'cpu'"):
        make_attention("cpu", 64, 2, 64, None, "cpu", torch.float32)
    with pytest.raises(ValueError, match="must be 'auto'"):
        make_attention("flash", 8, 2, 64, None, "cpu", torch.float32)


def test_without_a_compiler_auto_falls_back_to_the_portable_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TWOSPEED_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    load_kernel.cache_clear()
    try:
        assert load_kernel() is None
        assert type(make_attention("auto", 8, 2, 64, None, "cpu", torch.float32)) is TorchPagedAttention
    finally:
        load_kernel.cache_clear()


def test_loading_the_kernel_keeps_subnormals():
    """Built with -ffast-math, the library would switch the whole process to flush-to-zero at load time."""
    assert load_kernel() is not None
    tiny = 5e-324
    assert tiny * 1.0 > 0.0 and torch.tensor([1e-40]).mul(1.0).item() > 0.0


def prefill_batch(spans: list[tuple[int, int]], decodes: list[int], heads: int, kv_heads: int, head_dim: int,
                  block_size: int, window: int | None, seed: int):
    """Decodes then prefill chunks (context_len, num_tokens) on scattered blocks, as the runner lays them out;
    the context before each chunk is already in the cache."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = decodes + [c for c, _ in spans]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in need]
    slot = lambda t, p: t[p // block_size] * block_size + p % block_size  # noqa: E731
    cpu = torch.device("cpu")
    slots = [slot(t, n - 1) for t, n in zip(tables, decodes)]
    meta = AttentionMetadata(slot_mapping=torch.tensor([0]), num_decode_tokens=len(decodes))
    if decodes:
        width = max(need[:len(decodes)])
        meta.decodes.append(DecodeGroup(
            start=0, num_tokens=len(decodes),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:len(decodes)]]),
            mask=decode_mask(decodes, width * block_size, window, cpu), seq_lens=torch.tensor(decodes)))
    start = len(decodes)
    for (ctx, n), table in zip(spans, tables[len(decodes):]):
        slots += [slot(table, p) for p in range(ctx - n, ctx)]
        meta.prefills.append(PrefillSpan(start=start, num_tokens=n, context_len=ctx, block_table=torch.tensor(table),
                                         mask=causal_mask(n, ctx, window, cpu)))
        start += n
    meta.slot_mapping = torch.tensor(slots)
    if spans:
        width = max(len(t) for t in tables[len(decodes):])
        meta.prefill_batch = PrefillBatch(
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[len(decodes):]]),
            q_start=torch.tensor([p.start for p in meta.prefills]), q_len=torch.tensor([n for _, n in spans]),
            context_len=torch.tensor([c for c, _ in spans]))
    t = start
    q = torch.randn(t, heads, head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    return q, k, v, k_cache, v_cache, meta


PREFILL_CASES = [  # spans (context_len, num_tokens), decodes, heads, kv_heads, head_dim, block_size, window
    ([(1, 1)], [], 4, 4, 8, 16, None),  # a one-token prompt
    ([(512, 512)], [], 12, 4, 64, 16, None),  # a whole prompt
    ([(300, 37), (17, 17), (90, 5)], [40, 3], 12, 4, 64, 16, None),  # continuing chunks beside decodes
    ([(77, 77), (200, 123)], [], 6, 1, 12, 8, None),  # MQA, small head_dim, 8-token blocks
    ([(129, 64), (40, 40)], [9], 8, 2, 10, 16, 20),  # sliding window
    ([(150, 150)], [], 4, 2, 256, 64, None),  # head_dim and block_size at the limits
    ([(33, 33), (65, 65)], [], 16, 1, 128, 32, 7),  # G = 16, a window shorter than a key group
]


@needs_kernel(load_bf16_kernel, "attention_bf16")
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_kernel_matches_portable(case, monkeypatch):
    args = prefill_batch(*PREFILL_CASES[case], seed=case)
    heads, kv_heads, head_dim, _, window = PREFILL_CASES[case][2:]
    ref_cache = [t.clone() for t in args[3:5]]
    expected = TorchPagedAttention(heads, kv_heads, head_dim).forward(*args[:3], *ref_cache, args[5])
    attn = CpuPagedAttention(heads, kv_heads, head_dim, window)
    assert attn.prefill_kernel is not None
    attn.flash_rows = None  # the kernel for every span, as on a CPU without AMX

    def portable_prefill(*a, **k):
        raise AssertionError("the portable prefill ran")
    monkeypatch.setattr(TorchPagedAttention, "prefill_spans", portable_prefill)  # the kernel must do all of it
    got = attn.forward(*args)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


F32_CASES = [case for case, c in enumerate(PREFILL_CASES) if c[4] % 8 == 0]  # the AVX2 kernel's head_dim


@pytest.mark.parametrize("bf16_cache", [False, True], ids=["f32-cache", "bf16-cache"])
@pytest.mark.parametrize("case", F32_CASES)
def test_f32_prefill_kernel_matches_portable(case, bf16_cache, monkeypatch):
    """float32 queries (a bf16 checkpoint computing in float32 on a CPU without bf16 kernels) over a float32 cache,
    or a bf16 one (Bf16KV): every span through csrc/paged_attention.c's AVX2 prefill (the 512-row one included),
    against the portable path."""
    from twospeed.model.kv_format import Bf16KV, KVFormat

    if not load_kernel().prefill_f32:
        pytest.skip("no AVX2 + FMA here: float32 prefill chunks stay on the portable path")
    q, k, v, k_cache, v_cache, meta = prefill_batch(*PREFILL_CASES[case], seed=case)
    q, k, v = q.float(), k.float(), v.float()
    if not bf16_cache:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    heads, kv_heads, head_dim, _, window = PREFILL_CASES[case][2:]
    kv = Bf16KV() if bf16_cache else KVFormat()
    ref_cache = [t.clone() for t in (k_cache, v_cache)]
    expected = TorchPagedAttention(heads, kv_heads, head_dim, kv).forward(q, k, v, *ref_cache, meta)
    attn = CpuPagedAttention(heads, kv_heads, head_dim, window, kv)
    assert attn.f32_prefill

    def portable_prefill(*a, **kw):
        raise AssertionError("the portable prefill ran")
    monkeypatch.setattr(TorchPagedAttention, "prefill_spans", portable_prefill)
    got = attn.forward(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache, ref_cache[0]) and torch.equal(v_cache, ref_cache[1])  # the same cache writes
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@needs_kernel(load_bf16_kernel, "attention_bf16")
@pytest.mark.parametrize("case", [2, 4])
def test_amx_split_sends_short_spans_to_the_kernel_and_long_ones_to_flash(case, monkeypatch):
    """With the AMX rule, spans over flash_rows tokens go to the gather + SDPA path and the rest to the kernel,
    in one step, and the output is the portable one."""
    args = prefill_batch(*PREFILL_CASES[case], seed=case)
    heads, kv_heads, head_dim, _, window = PREFILL_CASES[case][2:]
    ref_cache = [t.clone() for t in args[3:5]]
    expected = TorchPagedAttention(heads, kv_heads, head_dim).forward(*args[:3], *ref_cache, args[5])
    attn = CpuPagedAttention(heads, kv_heads, head_dim, window)
    attn.flash_rows = 6  # case 2: 37 and 17 to flash, 5 to the kernel; case 4: 64 and 40 to flash
    seen = []
    kernel = attn.prefill_kernel

    class Spy:
        def prefill_attention_bf16(self, *a):
            seen.append(a[8])  # the number of spans the kernel got
            return kernel.prefill_attention_bf16(*a)
    attn.prefill_kernel = Spy()
    got = attn.forward(*args)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert seen == ([1] if case == 2 else [])


@needs_kernel(load_bf16_kernel, "attention_bf16")
@pytest.mark.parametrize("case", [2, 3, 4])
def test_fused_rope_and_cache_write_match_the_unfused_path(case):
    """forward_fused(qkv) == forward(apply_rope(q), apply_rope(k), v): the same output and the same cache bits."""
    from twospeed.config import ModelConfig
    from twospeed.model.llama import RotaryEmbedding, apply_rope

    spans, decodes, heads, kv_heads, head_dim, block_size, window = PREFILL_CASES[case]
    q, k, v, k_cache, v_cache, meta = prefill_batch(spans, decodes, heads, kv_heads, head_dim, block_size, window,
                                                    seed=case)
    t = q.shape[0]
    g = torch.Generator().manual_seed(case)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    cfg = ModelConfig("LlamaForCausalLM", 100, 32, 64, 1, heads, kv_heads, head_dim, rope_theta=10000.0)
    positions = torch.tensor([n - 1 for n in decodes] + [p for c, n in spans for p in range(c - n, c)])
    cos, sin = RotaryEmbedding(cfg, 1024, torch.bfloat16).lookup(positions)
    qk = apply_rope(qkv[:, :(heads + kv_heads) * head_dim].view(t, -1, head_dim), cos, sin)
    rq, rk = qk.split([heads, kv_heads], dim=1)
    rv = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    attn = CpuPagedAttention(heads, kv_heads, head_dim, window)
    ref_cache = [k_cache.clone(), v_cache.clone()]
    expected = attn.forward(rq, rk, rv, *ref_cache, meta)
    assert attn.fused_rope_ok(qkv) == (t <= 64)  # longer steps keep torch's vector RoPE; the kernel is exact anyway
    got = attn.forward_fused(qkv, cos, sin, k_cache, v_cache, meta)
    assert torch.equal(k_cache, ref_cache[0]) and torch.equal(v_cache, ref_cache[1])
    assert torch.equal(got, expected)
