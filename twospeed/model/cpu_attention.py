"""The CPU fast path of paged attention: decode tokens read their KV blocks in place (csrc/paged_attention.c).

Same interface as `TorchPagedAttention`, which stays the portable path and the reference it is tested
against (tests/test_cpu_attention.py). Decodes go to the C kernel; prefill chunks, compute-bound, keep the
portable batched SDPA. Decode groups may be padded: the kernel reads only each sequence's own length. The kernel
is compiled on first use (model/cbuild.py); if there is no compiler or the build fails, `load_kernel()` returns
None and the engine uses the portable path.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from twospeed.model.attention import AttentionMetadata, TorchPagedAttention
from twospeed.model.cbuild import build_library

_P = ctypes.c_void_p
_I = ctypes.c_int


@lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """The kernel library (built once per source, compiler and CPU; model/cbuild.py), or None."""
    kernel = build_library("paged_attention")
    if kernel is None:
        return None
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        getattr(kernel, name).argtypes = [_P] * 6 + [_I] * 7 + [ctypes.c_float, _I]
        getattr(kernel, name).restype = None
    limits = [ctypes.c_int() for _ in range(3)]
    kernel.paged_attention_limits(*(ctypes.byref(x) for x in limits))
    kernel.limits = tuple(x.value for x in limits)  # (max G, max head_dim, max block_size)
    return kernel


def kernel_supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    kernel = load_kernel()
    if kernel is None or dtype not in (torch.bfloat16, torch.float32):
        return False
    max_g, max_d, max_bs = kernel.limits
    return num_heads // num_kv_heads <= max_g and head_dim <= max_d and block_size <= max_bs


class CpuPagedAttention(TorchPagedAttention):
    """Decodes through the in-place C kernel; prefill chunks through the portable path."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.kernel = load_kernel()
        self.window = sliding_window or 0
        self.scale = head_dim ** -0.5

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               out: torch.Tensor) -> None:
        if q.device.type != "cpu" or k_cache.shape[1] > self.kernel.limits[2]:
            return super().decode(q, k_cache, v_cache, meta, out)
        fn = self.kernel.paged_decode_bf16 if q.dtype == torch.bfloat16 else self.kernel.paged_decode_f32
        q = q.contiguous()
        threads = torch.get_num_threads()
        for group in meta.decodes:
            s, n = group.start, group.num_tokens
            tables, lens = group.block_tables, group.seq_lens
            fn(q[s].data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
               out[s].data_ptr(), n, self.num_heads, self.num_kv_heads, self.head_dim, k_cache.shape[1],
               tables.shape[1], self.window, self.scale, threads)


def make_attention(backend: str, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None,
                   device: torch.device | str, dtype: torch.dtype) -> TorchPagedAttention:
    """backend "auto": the C kernel on CPU where it builds and fits the shapes, else portable; "torch": portable;
    "cpu": the kernel or an error."""
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'cpu', got {backend!r}")
    fits = torch.device(device).type == "cpu" and kernel_supports(num_heads, num_kv_heads, head_dim, 1, dtype)
    if backend == "cpu" and not fits:
        raise ValueError("attention_backend 'cpu' needs a CPU device, a C compiler, bf16 or fp32, "
                         "at most 16 query heads per KV head and head_dim <= 256")
    if backend != "torch" and fits:
        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, sliding_window)
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
