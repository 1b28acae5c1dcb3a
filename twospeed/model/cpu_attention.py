"""The CPU fast path of paged attention: C kernels that read the KV blocks in place.

Same interface as `TorchPagedAttention`, which stays the portable path and the reference they are tested
against (tests/model/test_cpu_attention.py). Two libraries, compiled on first use (model/cbuild.py):
- csrc/attention_bf16.c (AVX-512 BF16): bf16 decodes and bf16 prefill chunks (even head_dim), which the
  portable path sends through torch's CPU flash attention after gathering earlier chunks' blocks (on AMX CPUs
  that path is the faster one for chunks over FLASH_ROWS tokens, and takes them);
- csrc/paged_attention.c (any x86/ARM compiler target): decodes in fp32, and in bf16 where the first does not
  build; with AVX2 + FMA also float32 prefill chunks over a float32 or bf16 cache (a bf16 checkpoint computing in
  float32 on a CPU without bf16 instructions), read in place. Other prefill chunks keep the portable batched SDPA.
Decode groups may be padded: the kernels read only each sequence's own length. Where neither builds,
`load_kernel()` returns None and the engine uses the portable path. A quantized cache (int8, fp8:
model/kv_format.py) is read in place by every kernel (attention_bf16.c takes the format as an argument,
paged_attention.c has *_i8 / *_f8 decodes, and *_f32_b16 for a float32 model's bf16 cache) and written by the
fused RoPE + cache write as the portable path's encoder writes it.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from twospeed.model.attention import AttentionMetadata, PrefillBatch, TorchPagedAttention
from twospeed.model.cbuild import load_library
from twospeed.model.kv_format import Bf16KV, KVFormat
from twospeed.model.packed_linear import has_amx

# Prefill chunks up to this many tokens stay on the C kernel on AMX CPUs (at 4 rows it is 5-20% faster than the
# gather + flash attention, at 8 rows 20-35% slower).
FLASH_ROWS = 4
_P = ctypes.c_void_p
_I = ctypes.c_int


@lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """csrc/paged_attention.c (built once per source, compiler and CPU; model/cbuild.py), or None."""
    decode = [_P] * 6 + [_I] * 7 + [ctypes.c_float, _I]
    kernel = load_library("paged_attention", {f"paged_decode_{t}{kv}": decode for t in ("bf16", "f32")
                                              for kv in ("", "_i8", "_f8")} | {
        "paged_decode_f32_b16": decode, "paged_prefill_f32": [_P] * 8 + [_I] * 7 + [ctypes.c_float, _I, _I],
        "paged_prefill_has_avx2": []})
    if kernel is None:
        return None
    limits = [ctypes.c_int() for _ in range(3)]
    kernel.paged_attention_limits(*(ctypes.byref(x) for x in limits))
    kernel.limits = tuple(x.value for x in limits)  # (max G, max head_dim, max block_size)
    kernel.paged_prefill_has_avx2.restype = _I
    kernel.prefill_f32 = bool(kernel.paged_prefill_has_avx2())  # the AVX2 prefill, else float32 chunks stay portable
    return kernel


@lru_cache(maxsize=1)
def load_bf16_kernel() -> ctypes.CDLL | None:
    """csrc/attention_bf16.c (AVX-512 BF16: decode, prefill, RoPE + cache write), or None where it cannot be built."""
    kernel = load_library("attention_bf16", {
        "prefill_attention_bf16": [_P] * 8 + [_I] * 7 + [ctypes.c_float, _I, _I],
        "decode_attention_bf16": [_P] * 6 + [_I] * 7 + [ctypes.c_float, _I, _I],
        "rope_write_bf16": [_P, ctypes.c_int64, _P, _P, _P, _P, _P, _P] + [_I] * 6})
    if kernel is None:
        return None
    limits = [ctypes.c_int() for _ in range(2)]
    kernel.attention_bf16_limits(*(ctypes.byref(x) for x in limits))
    kernel.limits = tuple(x.value for x in limits)  # (max G, max head_dim)
    return kernel


def kernel_supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    kernel = load_kernel()
    if kernel is None or dtype not in (torch.bfloat16, torch.float32):
        return False
    max_g, max_d, max_bs = kernel.limits
    return num_heads // num_kv_heads <= max_g and head_dim <= max_d and block_size <= max_bs


class CpuPagedAttention(TorchPagedAttention):
    """Decodes through the in-place C kernels; bf16 prefill chunks too where the AVX-512 BF16 kernel builds."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 kv: KVFormat | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, kv)
        self.kernel = load_kernel()
        self.window = sliding_window or 0
        self.scale = head_dim ** -0.5
        bf16 = load_bf16_kernel()
        fits = bf16 is not None and num_heads // num_kv_heads <= bf16.limits[0] and head_dim <= bf16.limits[1]
        self.bf16_kernel = bf16 if fits else None  # decode; prefill too where head_dim is even (k pairs)
        self.prefill_kernel = bf16 if fits and head_dim % 2 == 0 else None
        # Where oneDNN has AMX tiles, torch's flash attention (a gather of the cached blocks, then SDPA) beats this
        # kernel 2.3-3x on any chunk over FLASH_ROWS tokens, from position 0 or after 2k cached tokens alike
        # (BENCHMARKS.md); on AVX-512 BF16 without AMX the kernel keeps every chunk.
        self.flash_rows = FLASH_ROWS if has_amx() else None
        # float32 queries over a float32 or bf16 cache (a bf16 checkpoint on a CPU without bf16 kernels computes in
        # float32): csrc/paged_attention.c's AVX2 prefill, where it builds
        self.f32_prefill = (self.kernel.prefill_f32 and head_dim % 8 == 0
                            and num_heads // num_kv_heads <= self.kernel.limits[0]
                            and self.kv.code in (KVFormat.code, Bf16KV.code))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               out: torch.Tensor) -> None:
        if q.device.type != "cpu" or k_cache.shape[1] > self.kernel.limits[2]:
            return super().decode(q, k_cache, v_cache, meta, out)
        fn, fmt = self._decode_fn(q.dtype)
        q = q.contiguous()
        threads = torch.get_num_threads()
        for group in meta.decodes:
            s, n = group.start, group.num_tokens
            tables, lens = group.block_tables, group.seq_lens
            fn(q[s].data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
               out[s].data_ptr(), n, self.num_heads, self.num_kv_heads, self.head_dim, k_cache.shape[1],
               tables.shape[1], self.window, self.scale, *fmt, threads)

    def _decode_fn(self, dtype: torch.dtype) -> tuple:
        """The decode kernel for this query dtype and cache format, and the format argument it takes (attention_bf16.c's
        takes the cache format; paged_attention.c has a function per format)."""
        if dtype == torch.bfloat16 and self.bf16_kernel is not None:
            return self.bf16_kernel.decode_attention_bf16, (self.kv.code,)
        suffix = {0: "", 1: "_i8", 2: "_f8", 3: "_b16"}[self.kv.code]  # _b16: float32 queries only (Bf16KV)
        return getattr(self.kernel, f"paged_decode_{'bf16' if dtype == torch.bfloat16 else 'f32'}{suffix}"), ()

    def fused_rope_ok(self, qkv: torch.Tensor) -> bool:
        """forward_fused applies: bf16 on CPU with both kernels (its prefill must not need the fresh k, v), and a
        decode-sized step: the kernel's RoPE is scalar, slower than torch's vector ops over a long prefill
        (1024 tokens: +18 ms) and faster where torch's per-op dispatch dominates (batch 1: -0.5 ms a step).
        Batch-invariant: every step, so a row's RoPE never changes path with the row count."""
        return ((qkv.shape[0] <= 64 or self.batch_invariant) and self.prefill_kernel is not None
                and qkv.dtype == torch.bfloat16
                and qkv.device.type == "cpu" and qkv.stride(1) == 1)

    def forward_fused(self, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE on q and k, the cache write and the attention: `forward` for the fused qkv projection's output
        [T, (H + 2 KVH) hd] with this step's cos and signed sin [T, 1, hd] (as RotaryEmbedding.lookup gives)."""
        t = qkv.shape[0]
        q = torch.empty(t, self.num_heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        self.prefill_kernel.rope_write_bf16(
            qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin_signed.data_ptr(), meta.slot_mapping.data_ptr(),
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), t, self.num_heads, self.num_kv_heads,
            self.head_dim, self.kv.code, torch.get_num_threads())
        out = torch.empty_like(q)
        self.decode(q, k_cache, v_cache, meta, out)
        if meta.prefills:
            self.prefill(q, None, None, k_cache, v_cache, meta, out)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        batch = meta.prefill_batch
        # the kernel, the cache-format argument it takes, and the widest span it gets (None: every span)
        if q.dtype == torch.bfloat16 and self.prefill_kernel is not None:
            # AMX: torch's flash attention takes the wider spans
            fn, fmt, rows = self.prefill_kernel.prefill_attention_bf16, self.kv.code, self.flash_rows
        elif q.dtype == torch.float32 and self.f32_prefill and k_cache.shape[1] <= self.kernel.limits[2]:
            # faster than the gather + SDPA at 4-2,048 rows (BENCHMARKS.md)
            fn, fmt, rows = self.kernel.paged_prefill_f32, int(self.kv.code == Bf16KV.code), None
        else:
            fn = None
        if batch is None or fn is None or q.device.type != "cpu":
            return super().prefill(q, k, v, k_cache, v_cache, meta, out)
        if rows is not None:  # spans over `rows` rows go to the portable path, which is faster there
            wide = [span for span in meta.prefills if span.num_tokens > rows]
            if wide:
                self.prefill_spans(wide, q, k, v, k_cache, v_cache, meta, out)
                if len(wide) == len(meta.prefills):
                    return
                keep = torch.tensor([i for i, span in enumerate(meta.prefills) if span.num_tokens <= rows])
                batch = PrefillBatch(batch.block_tables[keep], batch.q_start[keep], batch.q_len[keep],
                                     batch.context_len[keep])
        q = q.contiguous()
        # K/V of these chunks are already in the cache (write_cache ran first): the kernels read them there
        fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), batch.block_tables.data_ptr(),
           batch.q_start.data_ptr(), batch.q_len.data_ptr(), batch.context_len.data_ptr(), out.data_ptr(),
           len(batch.q_len), self.num_heads, self.num_kv_heads, self.head_dim, k_cache.shape[1],
           batch.block_tables.shape[1], self.window, self.scale, fmt, torch.get_num_threads())


def make_attention(backend: str, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                   device: torch.device | str, dtype: torch.dtype, kv: KVFormat | None = None) -> TorchPagedAttention:
    """backend "auto": the C kernel on CPU where it builds and fits the shapes, else portable; "torch": portable;
    "cpu": the kernel or an error. kv: how the cache stores K and V (model/kv_format.py; default the model's dtype)."""
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'cpu', got {backend!r}")
    fits = torch.device(device).type == "cpu" and kernel_supports(num_heads, num_kv_heads, head_dim, 1, dtype)
    if backend == "cpu" and not fits:
        raise ValueError("attention_backend 'cpu' needs a CPU device, a C compiler, bf16 or fp32, "
                         "at most 16 query heads per KV head and head_dim <= 256")
    if backend != "torch" and fits:
        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, sliding_window, kv)
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim, kv)
