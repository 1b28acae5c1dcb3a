"""Residual add + RMSNorm and SiLU-and-multiply: one C call each on CPU, in bf16 (csrc/fused_bf16.c) and in
float32 (csrc/fused_f32.c: a bf16 checkpoint computed in float32), torch ops elsewhere (the portable path and
the reference; tests/model/test_fused_ops.py compares them).

The C path is taken for contiguous-row CPU tensors when the library builds (a C compiler, and AVX-512 BF16 for
the bf16 one, model/cbuild.py); otherwise these functions run the same math as torch ops, rounding where HF does.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from twospeed.model.cbuild import load_library

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@lru_cache(maxsize=1)
def fused_kernel() -> ctypes.CDLL | None:
    return load_library("fused_bf16", {"add_rms_norm_bf16": [_P, _L, _P, _P, _P, _L, _I, _I, ctypes.c_float, _I],
                                       "silu_mul_bf16": [_P, _L, _P, _I, _I, _I]})


@lru_cache(maxsize=1)
def fused_f32_kernel() -> ctypes.CDLL | None:
    return load_library("fused_f32", {"add_rms_norm_f32": [_P, _L, _P, _P, _P, _L, _I, _I, ctypes.c_float, _I],
                                      "silu_mul_f32": [_P, _L, _P, _I, _I, _I]})


_LIBRARIES = {torch.bfloat16: fused_kernel, torch.float32: fused_f32_kernel}


def _kernel_for(x: torch.Tensor) -> ctypes.CDLL | None:
    """The fused library for x's dtype, where x is CPU rows with unit column stride and the library builds."""
    loader = _LIBRARIES.get(x.dtype)
    if loader is None or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        return None
    return loader()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             use_kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (or x), then HF's RMSNorm of s: normalise in float32, round, scale by the weight.
    Returns (normed, s); s is the residual stream for the next add (written into `residual` in place)."""
    lib = _kernel_for(x) if use_kernel else None
    if lib is not None and (residual is None or residual.is_contiguous()) and weight.dtype == x.dtype:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        fn = lib.add_rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.add_rms_norm_f32
        fn(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), weight.data_ptr(),
           out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out, (x if residual is None else residual)
    s = x if residual is None else residual.add_(x)
    return weight * F.rms_norm(s.float(), weight.shape, None, eps).to(x.dtype), s


def silu_mul(gate_up: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, each rounded to the input dtype as F.silu(g) * u rounds."""
    lib = _kernel_for(gate_up) if use_kernel else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    fn = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul_f32
    fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
    return out
