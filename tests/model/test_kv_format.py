"""Quantized KV cache (int8 with a bf16 scale per token and KV head, fp8 e4m3, and bf16 under a float32 model): the
encoding, every attention path reading it against a float64 attention over the dequantized cache, a planted wrong
scale caught, and the pool holding about twice the tokens in the same memory.

Bound: attention output within 2e-5 + 1e-4 |ref| (fp32 queries) or one bf16 rounding plus 1e-3 (bf16 queries)
of the float64 attention over the values the cache holds: the kernels compute in float32 over exact widenings.
"""

from __future__ import annotations

import random

import pytest
import torch

from twospeed.config import CacheConfig, ModelConfig
from twospeed.engine.runner import kv_bytes_per_token, num_blocks_for
from twospeed.model.attention import AttentionMetadata, DecodeGroup, PrefillBatch, PrefillSpan, TorchPagedAttention
from twospeed.model.attention import causal_mask, decode_mask
from twospeed.model.cpu_attention import CpuPagedAttention, load_bf16_kernel, load_kernel
from twospeed.model.kv_format import Bf16KV, Fp8KV, Int8KV, KVFormat, make_kv_format

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the kernel cannot be built")
FORMATS = [Int8KV(), Fp8KV()]


def test_int8_rows_hold_values_and_their_scale():
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 2, 5)[:, None, None]
    x[0, 1] = 0  # an all-zero row
    kv = Int8KV()
    rows = kv.encode(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 66)
    back = kv.decode(rows, torch.float32)
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()
    assert torch.equal(back[0, 1], torch.zeros(64))
    assert bool(((back - x).abs() <= scale * 0.5 * (1 + 1e-6) + 1e-30).all())  # half a step
    assert bool((rows[..., :64].abs() <= 127).all())


def test_fp8_keeps_three_mantissa_bits():
    x = torch.randn(7, 2, 32) * 10
    back = Fp8KV().decode(Fp8KV().encode(x), torch.float32)
    normal = x.abs() >= 2.0 ** -6
    assert bool(((back - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -4).all())


def paged(lens: list[int], kv_heads: int, head_dim: int, block_size: int, kv: KVFormat, dtype: torch.dtype, seed: int):
    """A quantized pool with each sequence's tokens on scattered blocks; returns the pool tensors and tables."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k_cache = kv.allocate((num_blocks, block_size, kv_heads), head_dim, dtype, "cpu")
    v_cache = kv.allocate((num_blocks, block_size, kv_heads), head_dim, dtype, "cpu")
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in need]
    for table, n in zip(tables, lens):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        # spread magnitudes so per-row scales differ a lot
        kv.write(k_cache, slots, (torch.randn(n, kv_heads, head_dim, generator=g) * 3).to(dtype))
        kv.write(v_cache, slots, torch.randn(n, kv_heads, head_dim, generator=g).to(dtype))
    return k_cache, v_cache, tables


def reference(q: torch.Tensor, k_cache, v_cache, kv: KVFormat, table: list[int], length: int, positions: list[int],
              window: int | None, weights_of_abs: bool = False) -> torch.Tensor:
    """float64 attention of queries at `positions` over the dequantized cache of one sequence (weights_of_abs: the
    same weights over |V| instead, which bounds the error of rounding the weights)."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    ids = torch.tensor(table)
    k = kv.decode(kv.gather(k_cache, ids), torch.float64).flatten(0, 1)[:length]  # [L, KVH, D]
    v = kv.decode(kv.gather(v_cache, ids), torch.float64).flatten(0, 1)[:length]
    g = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(positions):
        keys = torch.arange(length)
        seen = (keys <= pos) & ((keys > pos - window) if window else True)
        for h in range(q.shape[1]):
            s = (k[seen, h // g] @ q[i, h].double()) * q.shape[-1] ** -0.5
            vals = v[seen, h // g].abs() if weights_of_abs else v[seen, h // g]
            out[i, h] = torch.softmax(s, 0) @ vals
    return out


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, portable: bool = False,
          p_rounded: torch.Tensor | None = None) -> bool:
    """fp32: 2e-5 + 1e-4 |ref|. bf16: the C kernels (float32 math over exact widenings) one output rounding plus
    1e-3, and where they round the softmax weights to bf16 (bf16 prefill and decode, as torch's flash attention does) one rounding
    of each weight: 2^-8 sum_j p_j |v_j| (p_rounded); the portable path rounds K and V to bf16 and runs SDPA in
    bf16, so 2e-2 + 2e-2 |ref| (the bf16 tolerance tests/model/test_cpu_attention.py holds the kernels to against it)."""
    err = (got.double() - ref).abs()
    if dtype == torch.float32:
        return bool((err <= 2e-5 + 1e-4 * ref.abs()).all())
    if portable:
        return bool((err <= 2e-2 + 2e-2 * ref.abs()).all())
    extra = 0 if p_rounded is None else 2.0 ** -8 * p_rounded
    return bool((err <= 1e-3 + 2.0 ** -8 * ref.abs() + extra).all())


def decode_meta(lens, tables, block_size, window):
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64), num_decode_tokens=len(lens))
    meta.decodes.append(DecodeGroup(
        start=0, num_tokens=len(lens), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        mask=decode_mask(lens, width * block_size, window, torch.device("cpu")), seq_lens=torch.tensor(lens)))
    return meta


CASES = [  # lens, heads, kv_heads, head_dim, block_size, window
    ([17, 3, 64, 65, 200], 12, 4, 64, 16, None),
    ([5, 40, 33], 6, 1, 12, 8, None),  # MQA, odd head_dim
    ([90, 7, 129], 8, 2, 10, 16, 20),  # sliding window
    ([300], 4, 2, 128, 32, None),
]


def check_decode(kv: KVFormat, dtype: torch.dtype, spec: tuple, backend: str, seed: int) -> None:
    """Decode queries over a paged cache in `kv`, each sequence's output against the float64 reference."""
    lens, heads, kv_heads, head_dim, block_size, window = spec
    k_cache, v_cache, tables = paged(lens, kv_heads, head_dim, block_size, kv, dtype, seed=seed)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(9)).to(dtype)
    attn = (CpuPagedAttention(heads, kv_heads, head_dim, window, kv) if backend == "cpu"
            else TorchPagedAttention(heads, kv_heads, head_dim, kv))
    out = torch.empty_like(q)
    attn.decode(q, k_cache, v_cache, decode_meta(lens, tables, block_size, window), out)
    for i, (n, table) in enumerate(zip(lens, tables)):
        ref = reference(q[i:i + 1], k_cache, v_cache, kv, table, n, [n - 1], window)
        # the bf16 decode kernel rounds the softmax weights to bf16 for P x V, as the prefill kernel does
        pv = reference(q[i:i + 1], k_cache, v_cache, kv, table, n, [n - 1], window, weights_of_abs=True)
        assert close(out[i:i + 1], ref, dtype, backend == "torch", p_rounded=pv if dtype == torch.bfloat16 else None), \
            (i, (out[i:i + 1].double() - ref).abs().max())


@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernel)])
def test_decode_over_a_quantized_cache_matches_the_dequantized_reference(kv, dtype, case, backend):
    check_decode(kv, dtype, CASES[case], backend, seed=case)


BF16_CASES = [*CASES, ([1500, 3], 9, 3, 64, 16, None),  # one long context: split across threads on AVX2
              ([1500], 8, 2, 64, 16, 700)]


@pytest.mark.parametrize("case", range(len(BF16_CASES)))
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernel)])
def test_decode_over_a_bf16_cache_under_float32_queries(case, backend):
    """A float32 model's bf16 cache (each value its float32 rounded to nearest even): the float32 decode reads
    those values within the float32 bound."""
    check_decode(Bf16KV(), torch.float32, BF16_CASES[case], backend, seed=case)


def test_bf16_format_rounds_as_torch_and_is_plain_under_a_bf16_model():
    x = torch.randn(6, 2, 16) * 7
    assert torch.equal(Bf16KV().encode(x), x.to(torch.bfloat16))
    assert type(make_kv_format("bf16", torch.float32)) is Bf16KV
    assert type(make_kv_format("bf16", torch.bfloat16)) is KVFormat  # a bf16 model's "auto"
    cfg = ModelConfig("LlamaForCausalLM", 32000, 768, 2048, 12, 12, 4, 64)
    assert kv_bytes_per_token(cfg, torch.float32, "bf16") * 2 == kv_bytes_per_token(cfg, torch.float32, "auto")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_wrong_scale_in_the_cache_is_caught(dtype):
    """Planted error: one token's K scale doubled in the cache moves the kernel's output beyond the bound."""
    kv, lens = Int8KV(), [40]
    k_cache, v_cache, tables = paged(lens, 2, 32, 16, kv, dtype, seed=3)
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = reference(q, k_cache, v_cache, kv, tables[0], 40, [39], None)
    slot = k_cache.view(-1, 2, 34)[tables[0][1] * 16 + 5, 0]  # token 21, KV head 0
    scale = slot[32:].view(torch.bfloat16)
    scale *= 2
    attn, out = CpuPagedAttention(4, 2, 32, None, kv), torch.empty_like(q)
    attn.decode(q, k_cache, v_cache, decode_meta(lens, tables, 16, None), out)
    assert not close(out, ref, dtype)


@pytest.mark.parametrize("kv", FORMATS, ids=lambda k: k.name)
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernel)])
def test_prefill_chunks_attend_to_the_quantized_cache(kv, backend):
    """A first chunk and a continuing one, beside a decode: every query sees the values the cache holds, its
    own chunk's included."""
    heads, kv_heads, head_dim, bs, dtype = 4, 2, 16, 8, torch.bfloat16
    lens = [30, 19]  # a decode at position 29; a 19-token prompt's last 7 tokens continuing 12 cached
    k_cache, v_cache, tables = paged(lens, kv_heads, head_dim, bs, kv, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1 + 7 + 5, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(13, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(13, kv_heads, head_dim, generator=g).to(dtype)
    first_table = [min(set(range(1, k_cache.shape[0])) - set(tables[0]) - set(tables[1]))]  # a new 5-token prompt
    cont_slots = [tables[1][p // bs] * bs + p % bs for p in range(12, 19)]
    slots = [tables[0][29 // bs] * bs + 29 % bs] + cont_slots + [first_table[0] * bs + p for p in range(5)]
    meta = decode_meta([30], [tables[0]], bs, None)
    meta.slot_mapping = torch.tensor(slots)
    meta.prefills = [PrefillSpan(1, 7, 19, torch.tensor(tables[1]), causal_mask(7, 19, None, torch.device("cpu"))),
                     PrefillSpan(8, 5, 5, torch.tensor(first_table), None)]
    meta.prefill_batch = PrefillBatch(block_tables=torch.tensor([tables[1], first_table + [0] * (len(tables[1]) - 1)]),
                                      q_start=torch.tensor([1, 8]), q_len=torch.tensor([7, 5]),
                                      context_len=torch.tensor([19, 5]))
    attn = (CpuPagedAttention(heads, kv_heads, head_dim, None, kv) if backend == "cpu"
            else TorchPagedAttention(heads, kv_heads, head_dim, kv))
    out = attn.forward(q, k, v, k_cache, v_cache, meta)
    checks = [(slice(0, 1), tables[0], 30, [29]), (slice(1, 8), tables[1], 19, list(range(12, 19))),
              (slice(8, 13), first_table, 5, list(range(5)))]
    for rows, table, n, positions in checks:
        ref = reference(q[rows], k_cache, v_cache, kv, table, n, positions, None)
        pv = reference(q[rows], k_cache, v_cache, kv, table, n, positions, None, weights_of_abs=True)
        # the CPU backend sends prompt chunks to the portable path, with its tolerance, where the bf16 prefill
        # kernel does not build (no AVX-512 BF16) and, on AMX, for chunks over flash_rows tokens
        ported = backend == "cpu" and rows.start > 0 and (
            attn.prefill_kernel is None or (attn.flash_rows or 1 << 30) < rows.stop - rows.start)
        assert close(out[rows], ref, dtype, portable=backend == "torch" or ported, p_rounded=pv), \
            (rows, (out[rows].double() - ref).abs().max())


def test_a_quantized_pool_holds_about_twice_the_tokens():
    """Same memory budget: int8 (its scales included) >= 1.9x the bf16 pool's blocks, fp8 2x."""
    for head_dim in (64, 128):
        cfg = ModelConfig("LlamaForCausalLM", 32000, 768, 2048, 12, 12, 4, head_dim)
        blocks = {kv: num_blocks_for(cfg, CacheConfig(kv_cache_memory_gb=1.0, kv_cache_dtype=kv), torch.bfloat16)
                  for kv in ("auto", "int8", "fp8")}
        assert blocks["int8"] >= 1.9 * blocks["auto"] and blocks["fp8"] >= 1.99 * blocks["auto"]
        assert kv_bytes_per_token(cfg, torch.bfloat16, "int8") == 2 * 12 * 4 * (head_dim + 2)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    assert make_kv_format("auto").row_width(64) == 64 and make_kv_format("int8").row_width(64) == 66


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_engine_over_a_quantized_cache_agrees_between_attention_paths(tmp_path, kv):
    """fp32 model, a pool small enough to preempt: greedy tokens equal between the C decode kernel and the
    portable path over the same quantized cache, whatever the batch and chunking."""
    from conftest import float32_llm, write_hf_checkpoint
    from twospeed import SamplingParams

    write_hf_checkpoint(tmp_path, "llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 301) for _ in range(n)] for n in (5, 30, 61, 17)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runs = []
    for backend in ("torch", "cpu") if load_kernel() is not None else ("torch",):
        llm = float32_llm(tmp_path, kv_cache_dtype=kv, attention_backend=backend, num_gpu_blocks=10, block_size=8,
                          max_num_batched_tokens=16)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.scheduler.num_preemptions > 0  # 10 blocks of 8 cannot hold all four
        assert llm.engine.runner.kv_cache.shape[-1] == (14 if kv == "int8" else 12)
        assert llm.engine.runner.kv_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                                                    "bf16": torch.bfloat16}[kv]
    assert all(r == runs[0] for r in runs)


@pytest.mark.skipif(load_bf16_kernel() is None, reason="no AVX-512 BF16 kernel on this CPU")
@pytest.mark.parametrize("kv", [KVFormat(), *FORMATS], ids=lambda k: k.name)
def test_fused_rope_write_stores_what_the_portable_encoder_stores(kv):
    """The C pass (RoPE + cache write, decode-sized steps) writes the cache bytes the portable path writes:
    torch's RoPE then kv.encode, bit for bit (scales included)."""
    from twospeed.config import ModelConfig
    from twospeed.model.llama import RotaryEmbedding, apply_rope

    heads, kv_heads, head_dim, bs, t = 4, 2, 32, 8, 5
    cfg = ModelConfig("LlamaForCausalLM", 100, 128, 256, 1, heads, kv_heads, head_dim)
    rope = RotaryEmbedding(cfg, 64, torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g) * 4).to(torch.bfloat16)
    positions = torch.tensor([3, 17, 0, 40, 9])
    cos, sin = rope.lookup(positions)
    slots = torch.tensor([5, 12, 0, 30, 21])
    caches = []
    for fused in (True, False):
        k_cache = kv.allocate((4, bs, kv_heads), head_dim, torch.bfloat16, "cpu")
        v_cache = kv.allocate((4, bs, kv_heads), head_dim, torch.bfloat16, "cpu")
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0)
        attn = CpuPagedAttention(heads, kv_heads, head_dim, None, kv)
        if fused:
            q = torch.empty(t, heads, head_dim, dtype=torch.bfloat16)
            attn.prefill_kernel.rope_write_bf16(
                qkv.data_ptr(), qkv.stride(0), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
                slots.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), t, heads, kv_heads,
                head_dim, kv.code, 1)
        else:
            qk = apply_rope(qkv[:, :(heads + kv_heads) * head_dim].view(t, -1, head_dim), cos, sin)
            q, k = qk.split([heads, kv_heads], dim=1)
            attn.write_cache(k, qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim), k_cache,
                             v_cache, meta)
        caches.append((q, k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    for a, b in zip(*caches):
        assert torch.equal(a, b)


@pytest.mark.skipif(load_bf16_kernel() is None, reason="no AVX-512 BF16 kernel on this CPU")
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_bf16_engine_over_a_quantized_cache_kernels_against_the_portable_path(tmp_path, kv):
    """bf16: the fused RoPE + quantized write, the decode and prefill kernels against the portable path. They round
    differently (the portable path dequantizes to bf16), so greedy tokens agree, or at the first difference
    each side's token is in the other's top 3 (a near tie)."""
    from conftest import write_hf_checkpoint
    from twospeed import LLM, SamplingParams

    write_hf_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 263) for _ in range(n)] for n in (3, 24, 50)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    runs = [LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_dtype=kv, attention_backend=backend,
                num_gpu_blocks=64, max_num_batched_tokens=20).generate(prompts, params)
            for backend in ("torch", "cpu")]
    for a, b in zip(*runs):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[i].top and tb in a.logprobs[i].top
                break
