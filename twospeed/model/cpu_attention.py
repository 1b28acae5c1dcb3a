"""The CPU fast path of paged attention: decode tokens read their KV blocks in place (csrc/paged_attention.c).

Same interface as `TorchPagedAttention`, which stays the portable path and the reference it is tested
against (tests/test_cpu_attention.py). Decodes go to the C kernel; prefill chunks, compute-bound, keep the
portable batched SDPA. Decode groups may be padded: the kernel reads only each sequence's own length. The kernel is compiled on first use with the system C compiler (`CC`, else `cc`)
for this CPU (-march=native) into the twospeed cache folder, keyed by the source, flags and CPU; if there is no
compiler or the build fails, `load_kernel()` returns None and the engine uses the portable path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from twospeed.config import cache_root
from twospeed.model.attention import AttentionMetadata, TorchPagedAttention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
# Not -ffast-math: linking with it sets flush-to-zero for the whole process (crtfastmath). Reassociation
# alone lets the dot products vectorize; infinities stay (the online softmax starts from -inf).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fopenmp", "-shared", "-fPIC"]
_P = ctypes.c_void_p
_I = ctypes.c_int


def _cpu_id() -> str:
    """The CPU's model and feature flags (Linux), else what platform knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return " ".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


@lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """Build (once per source, compiler and flags) and load the kernel library; None where it cannot be."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: paged attention uses the portable torch path")
        return None
    # -march=native: a library built on another CPU (a shared cache folder) could hold illegal instructions here
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    lib = cache_root() / "kernels" / f"paged_attention-{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(out, lib)  # atomic: concurrent builders each publish a complete file
        kernel = ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("paged attention kernel unavailable (%s): using the portable torch path", detail)
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
