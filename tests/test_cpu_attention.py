"""The CPU decode kernel (csrc/paged_attention.c) against the portable TorchPagedAttention on the same
paged cache: scattered block tables, padded groups, partial blocks, GQA ratios, sliding windows, both dtypes."""

from __future__ import annotations

import random

import pytest
import torch

from twospeed.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, TorchPagedAttention, decode_mask
from twospeed.model.cpu_attention import CpuPagedAttention, load_kernel, make_attention

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the kernel cannot be built")


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
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_portable_decode(case, dtype):
    lens, heads, kv_heads, head_dim, block_size, window = CASES[case]
    args = decode_batch(lens, heads, kv_heads, head_dim, block_size, window, dtype, seed=case)
    ref_cache = [t.clone() for t in args[3:5]]
    expected = TorchPagedAttention(heads, kv_heads, head_dim).forward(*args[:3], *ref_cache, args[5])
    got = CpuPagedAttention(heads, kv_heads, head_dim, window).forward(*args)
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
