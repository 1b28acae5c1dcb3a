"""bf16 linears whose weights are packed once, at load, for a CPU kernel (the portable path is nn.Linear).

A decode step multiplies a few rows by every weight of the model, so it runs at the speed weights stream
from memory. Two packings, picked by `linear_backend`:

- "cpu": csrc/linear_bf16.c, AVX-512 BF16 dot products over weights in the VNNI pair layout, each weight read
  once per step. Against oneDNN's prepacked kernels, on two Zen 4 cores: 1.5-2.3x at 1 row, 1.2-1.8x at 4-8
  rows, 1.0-1.1x at 32-2048 rows (BENCHMARKS.md). Float32 accumulation, one rounding to bf16 per output, as
  oneDNN; the sums run in another order, so results can differ from `F.linear` by one bf16 rounding step.
  On CPUs with AMX (Sapphire Rapids and later) oneDNN's AMX tiles beat the kernel from a few rows up (2-10x
  at 8-64 rows, single thread), so there a "cpu" linear also keeps oneDNN's packing of the same weight and
  sends steps of more than `AMX_KERNEL_MAX_ROWS` rows (prefill chunks, wide decode batches) to it: twice the
  weight memory, no extra bytes read per step.
- "onednn": oneDNN's blocked layout (`F.linear` on a plain bf16 weight reorders it on every call). On Zen 4 the
  results were bit-identical to `F.linear` at every batch size; on Sapphire Rapids (AMX) oneDNN picks another
  kernel for the prepacked weight than for `F.linear`, so they agree to one bf16 rounding step, as the C kernel.
- "auto": the C kernel where it builds (a C compiler and AVX-512 BF16) and the input width is even, else
  oneDNN where it has bf16 kernels, else the plain `nn.Linear`. Any other device or dtype keeps `nn.Linear`.

tests/test_packed_linear.py checks both against a float64 reference and the engine's tokens against HF's.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import nn

from twospeed.model.cbuild import load_library

LINEAR_BACKENDS = ("auto", "cpu", "onednn", "torch")
# On AMX CPUs, rows up to this many take the C kernel, more take oneDNN's AMX path. Single-thread ratios
# kernel/oneDNN on a Sapphire Rapids core (768x2304, 768x4096, 2048x768, 768x32000): 1 row 0.46-0.86,
# 2 rows 0.70-0.94, 4 rows 0.47-1.05, 8 rows 0.97-2.39, 16 rows 1.1-6.1 (BENCHMARKS.md).
AMX_KERNEL_MAX_ROWS = 4
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@lru_cache(maxsize=1)
def linear_kernel() -> ctypes.CDLL | None:
    """csrc/linear_bf16.c, built on first use (model/cbuild.py); None without a compiler or AVX-512 BF16."""
    lib = load_library("linear_bf16", {"linear_bf16_pack": [_P, _P, _I, _I, _I],
                                       "linear_bf16": [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I]})
    if lib is not None:
        lib.tile_rows = lib.linear_bf16_tile_rows()
    return lib


def can_use_onednn(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN bf16 kernels exist for this CPU (AVX-512 BF16 / AMX, or their emulation on AVX-512)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


@lru_cache(maxsize=1)
def has_amx() -> bool:
    """oneDNN can use AMX tiles here (then it beats the C kernel beyond a few rows)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def resolve_linear_backend(backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """What `backend` means here: "cpu", "onednn" or "torch" (the plain nn.Linear); errors if it cannot run."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    cpu_bf16 = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    if backend == "cpu" and not (cpu_bf16 and linear_kernel() is not None):
        raise ValueError("linear_backend 'cpu' needs a CPU device, bf16 weights, a C compiler and AVX-512 BF16")
    if backend == "onednn" and not can_use_onednn(device, dtype):
        raise ValueError("linear_backend 'onednn' needs a CPU device, bf16 weights and oneDNN bf16 kernels")
    if backend == "auto":
        if cpu_bf16 and linear_kernel() is not None:
            return "cpu"
        return "onednn" if can_use_onednn(device, dtype) else "torch"
    return backend


class PackedLinear(nn.Module):
    """Drop-in for an inference-only bf16 nn.Linear; holds the packed weight instead of the original."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if backend == "cpu" and self.in_features % 2:
            backend = "onednn" if can_use_onednn(weight.device, weight.dtype) else "torch"  # pairs of k only
        self.backend = backend
        w = weight.detach()
        wide = None  # oneDNN's packing for steps of many rows (AMX CPUs, "cpu" backend)
        if backend == "cpu":
            lib = linear_kernel()
            tiles = -(-self.out_features // lib.tile_rows)
            packed = torch.empty(tiles * lib.tile_rows * self.in_features, dtype=w.dtype, device=w.device)
            w = w.contiguous()
            lib.linear_bf16_pack(w.data_ptr(), packed.data_ptr(), self.out_features, self.in_features,
                                 torch.get_num_threads())
            if has_amx() and can_use_onednn(w.device, w.dtype):
                wide = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        elif backend == "onednn":
            # the batch-size hint 1 picks the layout for decode's few rows; prefill-sized inputs ran as fast
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        else:
            packed = w
        self.register_buffer("weight_packed", packed, persistent=False)
        self.register_buffer("weight_wide", wide, persistent=False)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str) -> PackedLinear:
        return cls(linear.weight, linear.bias, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "cpu":
            if self.weight_wide is not None and x.numel() > AMX_KERNEL_MAX_ROWS * self.in_features:
                return torch.ops.mkldnn._linear_pointwise(x, self.weight_wide, self.bias, "none", [], "")
            return self._kernel(x)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight_packed, self.bias)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < self.in_features):
            x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            bias = None if self.bias is None else self.bias.data_ptr()
            linear_kernel().linear_bf16(x2.data_ptr(), x2.stride(0), self.weight_packed.data_ptr(), bias,
                                        y.data_ptr(), self.out_features, x2.shape[0], self.out_features,
                                        self.in_features, torch.get_num_threads())
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}")


def prepack_linears(model: nn.Module, backend: str) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear (freeing the plain weight); returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear.from_linear(child, backend))
    return len(swaps)
