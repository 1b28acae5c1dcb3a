"""Weight-only quantization: `int8` and `fp8` (e4m3) weights with a float32 scale per output row.

Quantized at load from a bf16/fp32 checkpoint, tensor by tensor as the loader hands them over (each linear's
weight_loader, model/weight_format.py), so the full-precision weights are never held beyond one tensor:

  int8  scale[n] = max_k |w[n, k]| / 127,  q = round(w / scale) in [-127, 127]   (symmetric, per output channel)
  fp8   scale[n] = max_k |w[n, k]| / 448,  q = e4m3(w / scale)                   (448: e4m3's largest normal)

and a linear computes y = (x . q^T) * scale + bias: the products of bf16 activations and 8-bit values are exact
in float32, so the only roundings are float32 summation and the output's one rounding (the same contract as
the bf16 kernel's). A decode step reads one byte a weight instead of two.

Two implementations behind `Q8Linear.forward`, tested against each other and a float64 reference
(tests/model/test_quant.py):
- `Q8Kernel` (CPU, bf16 activations): csrc/linear_q8.c. Decode-sized steps widen the bytes in registers
  (AVX-512 BF16 and VBMI table lookups); steps of more than `Q8_KERNEL_MAX_ROWS` rows on AMX CPUs widen a
  panel of weights to bf16 once per call in cache and run AMX tile dot products over every row (prefill).
- int8 with float32 activations (a CPU without bf16 kernels, model/compute_dtype.py): csrc/linear_widen.c
  widens the bytes in registers with AVX2, kept in its k-major panels of 16 rows, at every row count.
- the portable path (any device, any dtype): the same formula in float32 torch ops.

Test-only formats (accepted by `quantization`, never listed to users): `test-int4-per-tensor` (4-bit values,
one scale per checkpoint tensor) and `test-random-scale` (int8 with every row's scale off by up to 50%) are
deliberately destructive, so the gate's tests can check that a broken quantization is caught.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import nn

from twospeed.schema import formats
from twospeed.model.cbuild import load_library
from twospeed.model.packed_linear import from_panels, rows_2d, to_panels, widen_graph_call, widen_kernel, widened_linear
from twospeed.model.weight_format import FormatLinear, GraphCall, ShapeMismatch, WeightFormat

# Rows up to this many take the register-widening kernel; more take the AMX kernel where it runs. AMX time over
# register-kernel time, single thread, min of 9, a shared Sapphire Rapids core (768x2304, 768x4096, 2048x768):
# 4 rows 1.24-1.36, 6 rows 0.76-0.81, 16 rows 0.34-0.37 (`benchmarks/bench_quant.py --parts rows`).
Q8_KERNEL_MAX_ROWS = 4
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURE = [_P, _L, _P, _P, _P, _P, _L, _I, _I, _I, _I, _I]


@lru_cache(maxsize=1)
def q8_kernel() -> ctypes.CDLL | None:
    """csrc/linear_q8.c, built on first use; None without a compiler or AVX-512 BF16. `amx` says whether its
    AMX kernel runs here (compiled for AMX and the OS granted the tile state)."""
    lib = load_library("linear_q8", {"linear_q8_pack": [_P, _P, _I, _I, _I], "linear_q8": _SIGNATURE,
                                     "linear_q8_amx": _SIGNATURE, "linear_q8_init": []})
    if lib is not None:
        lib.linear_q8_init()  # the widening tables
        lib.linear_q8_packed_bytes.argtypes, lib.linear_q8_packed_bytes.restype = [_I, _I], _L
        lib.linear_q8_amx_init.restype = ctypes.c_int
        lib.amx = bool(lib.linear_q8_amx_init())
    return lib


class Q8Kernel:
    """The weight bytes packed for csrc/linear_q8.c (the VNNI pair layout, one byte each) with their scales."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, code: int):
        lib = q8_kernel()
        self.out_features, self.in_features = q.shape
        self.code, self.scale = code, scale.contiguous()
        size = lib.linear_q8_packed_bytes(self.out_features, self.in_features)
        self.packed = torch.empty(size, dtype=torch.uint8, device=q.device)
        lib.linear_q8_pack(q.contiguous().view(torch.uint8).data_ptr(), self.packed.data_ptr(), self.out_features,
                           self.in_features, torch.get_num_threads())
        self.amx = lib.amx and self.in_features % 32 == 0

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, wide: bool | None = None) -> torch.Tensor:
        """wide: force the AMX kernel (True) or the register kernel (False); None picks by the row count."""
        lead = x.shape[:-1]
        x2 = rows_2d(x, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        m = x2.shape[0]
        if m:
            lib = q8_kernel()
            use_amx = self.amx and (m > Q8_KERNEL_MAX_ROWS if wide is None else wide)
            fn = lib.linear_q8_amx if use_amx else lib.linear_q8
            fn(x2.data_ptr(), x2.stride(0), self.packed.data_ptr(), self.scale.data_ptr(),
               None if bias is None else bias.data_ptr(), y.data_ptr(), self.out_features, m, self.out_features,
               self.in_features, self.code, torch.get_num_threads())
        return y.view(*lead, self.out_features)


class Q8Format(WeightFormat):
    """8-bit weights with a float32 scale per output row. Subclasses say how values are stored and rounded."""

    storage: torch.dtype = torch.int8
    kernel_code = 0  # csrc/linear_q8.c's FMT_INT8 / FMT_FP8

    def __init__(self, use_kernel: bool, use_widen: bool = False):
        self.use_kernel = use_kernel  # bf16 activations: csrc/linear_q8.c (AVX-512 BF16)
        self.use_widen = use_widen  # float32 activations, int8 values: csrc/linear_widen.c (AVX2)

    @classmethod
    def resolve(cls, backend: str, device: torch.device, dtype: torch.dtype,
                stored: torch.dtype | None = None) -> Q8Format:
        if backend == "onednn":
            raise ValueError(f"quantization {cls.name!r} has no oneDNN path: linear_backend 'auto', 'cpu' or 'torch'")
        kernel = device.type == "cpu" and dtype == torch.bfloat16 and q8_kernel() is not None
        widen = (device.type == "cpu" and dtype == torch.float32 and cls.storage == torch.int8
                 and widen_kernel() is not None)
        if backend == "cpu" and not (kernel or widen):
            raise ValueError(f"linear_backend 'cpu' with quantization {cls.name!r} needs a CPU device, a C compiler "
                             "and bf16 activations with AVX-512 BF16 (or int8 with float32 activations and AVX2)")
        return cls(use_kernel=kernel and backend != "torch", use_widen=widen and backend != "torch")

    def linear(self, in_features: int, out_features: int, bias: bool,
               shard_sizes: list[int] | None = None) -> Q8Linear:
        return Q8Linear(self, in_features, out_features, bias, shard_sizes)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [rows, K] (any float dtype) -> (values [rows, K] in `storage`, scale [rows] float32)."""
        raise NotImplementedError

    @staticmethod
    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The weight these bytes stand for, in float32 (exact: scale times an 8-bit value, as the kernels see it)."""
        return q.float() * scale[:, None]


def row_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| per row in float32; an all-zero row gets 1 (any scale represents it)."""
    amax = w.float().abs().amax(dim=1)
    return torch.where(amax > 0, amax, torch.ones_like(amax))


class Int8Format(Q8Format):
    name = "int8"

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = row_amax(w) / 127
        return torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Fp8Format(Q8Format):
    name = "fp8"
    storage = torch.float8_e4m3fn
    kernel_code = 1
    FP8_MAX = 448.0  # e4m3's largest normal value

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = row_amax(w) / self.FP8_MAX
        return (w.float() / scale[:, None]).clamp_(-self.FP8_MAX, self.FP8_MAX).to(self.storage), scale


class Int4PerTensorTestFormat(Int8Format):
    """TEST ONLY, destructive on purpose: 4-bit values (-8..7) with one scale for the whole checkpoint tensor."""

    name = "test-int4-per-tensor"

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = w.float().abs().max().clamp_min(1e-30)
        scale = torch.full((w.shape[0],), float(amax) / 7, device=w.device)
        return torch.round(w.float() / scale[:, None]).clamp_(-8, 7).to(torch.int8), scale


class RandomScaleTestFormat(Int8Format):
    """TEST ONLY, destructive on purpose: correct int8 values, but every row's scale off by a factor in [0.5, 1.5]
    (seeded: the same model every load), as a planted bug in a scale computation would be."""

    name = "test-random-scale"

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = super().quantize(w)
        g = torch.Generator().manual_seed(w.shape[0] * 7919 + w.shape[1])
        return q, scale * (0.5 + torch.rand(w.shape[0], generator=g)).to(scale.device)


FORMATS: dict[str, type[Q8Format]] = {f.name: f for f in (Int8Format, Fp8Format, Int4PerTensorTestFormat,
                                                          RandomScaleTestFormat)}


class Q8Linear(FormatLinear):
    """A linear whose weight is quantized on load by `fmt`; forward through Q8Kernel where it applies, else
    the portable float32 formula."""

    def __init__(self, fmt: Q8Format, in_features: int, out_features: int, bias: bool,
                 shard_sizes: list[int] | None = None):
        super().__init__(in_features, out_features, bias, shard_sizes)
        self.fmt = fmt
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=fmt.storage), requires_grad=False)
        self._loads(self.weight, self.load_weight)
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.kernel: Q8Kernel | None = None
        self.panels: torch.Tensor | None = None  # csrc/linear_widen.c's layout of the bytes, where it runs

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        rows = self.rows(shard)
        dest = param.data[rows]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ShapeMismatch(tuple(dest.shape))
        q, scale = self.fmt.quantize(tensor.to(dest.device))
        dest.copy_(q)
        self.scale[rows] = scale

    def finish_loading(self) -> None:
        if self.fmt.use_kernel and self.in_features % 2 == 0:  # the kernel takes k in pairs
            self.kernel = Q8Kernel(self.weight.detach(), self.scale, self.fmt.kernel_code)
            del self.weight  # the packed bytes replace it
        elif self.fmt.use_widen:
            self.panels = to_panels(self.weight.detach())
            del self.weight  # the same bytes, 16 rows k-major

    def stored(self) -> torch.Tensor:
        """The weight's bytes [N, K], row-major, from wherever they are kept (not after Q8Kernel packs them)."""
        return from_panels(self.panels, self.out_features) if self.panels is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.forward(x, self.bias)
        if self.panels is not None and x.dtype == torch.float32:
            return widened_linear(x, self.panels, self.out_features, self.scale, self.bias)
        return self.portable(x)

    def portable(self, x: torch.Tensor) -> torch.Tensor:
        """(x . q^T) * scale + bias in float32, one rounding to x's dtype: the reference the kernels match."""
        y = torch.nn.functional.linear(x.float(), self.stored().float()) * self.scale
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype)

    def graph_calls(self) -> list[GraphCall] | None:
        """csrc/linear_widen.c's graph entry over the int8 panels, where the widened path runs."""
        if self.panels is None or self.panels.device.type != "cpu":
            return None
        call = widen_graph_call(self.panels, self.out_features, self.scale, self.bias)
        return None if call is None else [call]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this linear multiplies by (before packing)."""
        return self.fmt.dequantize(self.stored(), self.scale)

    @property
    def nbytes(self) -> int:
        return formats.weight_format(self.fmt.name).linear(self.out_features, self.in_features, 1) + self.bias_bytes()

    def describe(self) -> str:
        path = ("C kernel + AMX" if self.kernel.amx else "C kernel") if self.kernel is not None else (
            "AVX2 widening" if self.fmt.use_widen else "portable")
        return f"format={self.fmt.name}, {path}"
