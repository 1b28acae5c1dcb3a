"""The unquantized weight format: weights in the model's dtype, packed once at load for a CPU kernel in bf16.

A decode step multiplies a few rows by every weight of the model, so it runs at the speed weights stream
from memory. `DenseFormat` picks one packing per model from `linear_backend`; each is a small class with the
same `forward(x, bias)`:

- "cpu" (`KernelPacking`): csrc/linear_bf16.c, AVX-512 BF16 dot products over weights in the VNNI pair layout,
  each weight read once per step. Against oneDNN's prepacked kernels, on two Zen 4 cores: 1.5-2.3x at 1 row,
  1.2-1.8x at 4-8 rows, 1.0-1.1x at 32-2048 rows (BENCHMARKS.md). Float32 accumulation, one rounding to bf16 per
  output, as oneDNN; the sums run in another order, so results can differ from `F.linear` by one bf16 rounding
  step. On CPUs with AMX (Sapphire Rapids and later) oneDNN's AMX tiles beat the kernel from a few rows up
  (2-10x at 8-64 rows, single thread). There the same packed weight also feeds csrc/linear_amx.c, whose AMX
  tiles read it in the same layout: batched decode steps (up to `TILES_MAX_ROWS` rows) at memory speed. It
  also keeps oneDNN's packing of the same weight for steps of more rows (prefill chunks): twice the weight
  memory, no extra bytes read per step.
- "onednn" (`OneDnnPacking`): oneDNN's blocked layout (`F.linear` on a plain bf16 weight reorders it on every
  call). On Zen 4 bit-identical to `F.linear` at every batch size; on Sapphire Rapids (AMX) oneDNN picks another
  kernel for the prepacked weight than for `F.linear`, so they agree to one bf16 rounding step, as the C kernel.
- "cpu" on a CPU without bf16 kernels (`WidenPacking`): a bf16 checkpoint there computes in float32
  (model/compute_dtype.py), but its weights stay bf16, in k-major panels of 16 rows, and csrc/linear_widen.c
  (AVX2 + FMA) widens them in registers: half the bytes a decode step streams, and GEMM micro-kernels for
  batched steps and prefill chunks alike. Same float32 products as float32 weights, summed over k in order, so a
  row gets the same bits in any batch.
- "torch" (`PlainWeight`): `F.linear`, any device and dtype: the portable path the others are tested against.
- "auto": the C kernel where it builds (a C compiler and AVX-512 BF16), else oneDNN where it has bf16 kernels,
  else the widening kernel for a bf16 checkpoint computed in float32, else plain. A linear with an odd input
  width (no k pairs) takes oneDNN or plain instead of the AVX-512 kernel.

tests/model/test_packed_linear.py checks each against a float64 reference and the engine's tokens against HF's.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from twospeed.schema import formats
from twospeed.model.cbuild import load_library
from twospeed.model.weight_format import FormatLinear, GraphCall, WeightFormat, copy_checked

# On AMX CPUs, rows TILES_MIN_ROWS..TILES_MAX_ROWS take the AMX kernel (csrc/linear_amx.c), fewer the AVX-512
# kernel, more oneDNN's AMX path. The ~100M Llama's five linear shapes (one layer + lm_head), two threads on a
# Sapphire Rapids-class Xeon, ms (AVX-512 kernel / AMX kernel / oneDNN): 4 rows 2.6 / 3.3 / 4.4, 8 rows
# 5.5 / 3.1 / 5.4, 16 rows 10.1 / 3.2 / 3.7, 32 rows 15.4 / 2.9 / 8.1, 48 rows 28.0 / 7.2 / 8.0, 64 rows
# 35.8 / 7.5 / 7.0 (BENCHMARKS.md). Without the AMX kernel, the AVX-512 kernel takes up to AMX_KERNEL_MAX_ROWS
# (oneDNN/kernel time 1.78 at 1 row, 1.09-1.11 at 8, 0.64-0.70 at 12-24).
AMX_KERNEL_MAX_ROWS = 8
TILES_MIN_ROWS, TILES_MAX_ROWS = 5, 32
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
def amx_kernel() -> ctypes.CDLL | None:
    """csrc/linear_amx.c, built on first use; None without AMX (or a compiler for it), or where Linux refuses
    this process the tile state."""
    if not has_amx():
        return None
    lib = load_library("linear_amx", {"linear_amx": [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I]})
    if lib is None:
        return None
    lib.linear_amx_init.restype = ctypes.c_int
    return lib if lib.linear_amx_init() == 0 else None


@lru_cache(maxsize=1)
def has_amx() -> bool:
    """oneDNN can use AMX tiles here (then it beats the C kernel beyond a few rows)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def rows_2d(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as [rows, in_features] with unit column stride and rows no closer than in_features (what the C kernels
    read); a view where it already is one."""
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < in_features):
        x2 = x2.contiguous()
    return x2


class PlainWeight:
    """F.linear over the weight as loaded: any device, any dtype."""

    name = "torch"

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def graph_call(self, bias: torch.Tensor | None) -> GraphCall | None:
        return None  # no float32 C kernel: the decode graph stays off


class OneDnnPacking:
    """oneDNN's reordered bf16 layout, chosen once by a batch-size hint (`packing_rows_hint`)."""

    name = "onednn"

    def __init__(self, weight: torch.Tensor):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, packing_rows_hint())
        self.in_features = weight.shape[1]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if (padded := onednn_rows(m)) != m:
            x2 = F.pad(x2, (0, 0, 0, padded - m))  # zero rows: their outputs are dropped
        y = torch.ops.mkldnn._linear_pointwise(x2, self.weight, bias, "none", [], "")
        return y[:m].view(*lead, y.shape[-1])

    def graph_call(self, bias: torch.Tensor | None) -> GraphCall | None:
        return None  # no float32 C kernel: the decode graph stays off


def packing_rows_hint() -> int:
    """The batch size oneDNN is told to lay a weight out for. The hint only picks between two blocked layouts:
    1 gives AB16b64a2b, anything larger AB16b32a2b. On AMX the wide one is faster at nearly every row count
    oneDNN gets here (more than AMX_KERNEL_MAX_ROWS): the ~100M Llama's four linears of a layer 0.72-0.90x the
    time at 8-128 and 2,048-4,096 rows (1.12x at 512), its 32000-row lm_head 0.69-0.97x, two threads on Sapphire
    Rapids; prefill 0.75-0.86x in the engine (BENCHMARKS.md). Elsewhere (AVX-512 BF16 without AMX, Zen 4) hint 1
    was measured bit-identical to F.linear and as fast, and stays."""
    return 512 if has_amx() else 1


def onednn_rows(m: int) -> int:
    """The row count a oneDNN linear runs at: `m` rounded up to a bucket. oneDNN builds a primitive per shape on
    its first call (3-5 ms for one of the ~100M Llama's linears here, against ~1 ms to run it), so a step whose
    token count was new paid that in every linear of every layer (150+ ms) and the next step with it did not:
    chunked prefill makes every count from 1 to the budget likely. Buckets keep the shapes to about sixty, each
    built once. Decode-sized counts (up to 32) stay exact: there are few of them and padding costs most there."""
    if m <= 32:
        return m
    step = 32 if m <= 512 else 128 if m <= 2048 else 512
    return -(-m // step) * step


class KernelPacking:
    """csrc/linear_bf16.c's VNNI pair layout; on AMX CPUs also oneDNN's packing for steps of many rows."""

    name = "cpu"

    def __init__(self, weight: torch.Tensor):
        lib = linear_kernel()
        self.out_features, self.in_features = weight.shape
        tiles = -(-self.out_features // lib.tile_rows)
        self.weight = torch.empty(tiles * lib.tile_rows * self.in_features, dtype=weight.dtype, device=weight.device)
        w = weight.contiguous()
        lib.linear_bf16_pack(w.data_ptr(), self.weight.data_ptr(), self.out_features, self.in_features,
                             torch.get_num_threads())
        self.wide = OneDnnPacking(w) if has_amx() and can_use_onednn(w.device, w.dtype) else None
        self.tiles = amx_kernel() if self.wide is not None and self.in_features % 32 == 0 else None

    def graph_call(self, bias: torch.Tensor | None) -> GraphCall | None:
        return None  # bf16 activations: the decode graph runs float32 ones

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.wide is None:
            return self.kernel(x, bias)
        rows = x.numel() // self.in_features
        if self.tiles is not None and TILES_MIN_ROWS <= rows <= TILES_MAX_ROWS:
            return self.amx(x, bias)
        if rows <= AMX_KERNEL_MAX_ROWS:
            return self.kernel(x, bias)
        return self.wide.forward(x, bias)

    def kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The C kernel at any row count."""
        lead = x.shape[:-1]
        x2 = rows_2d(x, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            linear_kernel().linear_bf16(x2.data_ptr(), x2.stride(0), self.weight.data_ptr(),
                                        None if bias is None else bias.data_ptr(), y.data_ptr(), self.out_features,
                                        x2.shape[0], self.out_features, self.in_features, torch.get_num_threads())
        return y.view(*lead, self.out_features)

    def amx(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The AMX kernel (same packed weight) at any row count."""
        lead = x.shape[:-1]
        x2 = rows_2d(x, self.in_features)
        y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            self.tiles.linear_amx(x2.data_ptr(), x2.stride(0), self.weight.data_ptr(),
                                  None if bias is None else bias.data_ptr(), y.data_ptr(), self.out_features,
                                  x2.shape[0], self.out_features, self.in_features, torch.get_num_threads())
        return y.view(*lead, self.out_features)


# The decode graph runs its widened calls up to this many rows.
WIDEN_MAX_ROWS = 256
PANEL_ROWS = 16  # csrc/linear_widen.c's NR: weight rows per k-major panel


@lru_cache(maxsize=1)
def widen_kernel() -> ctypes.CDLL | None:
    """csrc/linear_widen.c, built on first use; None without a compiler or AVX2 + FMA."""
    return load_library("linear_widen", {"linear_widen": [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I],
                                         "linear_widen_i8": [_P, _L, _P, _P, _P, _P, _L, _I, _I, _I, _I]})


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> csrc/linear_widen.c's panels [ceil(N / 16), K, 16] in the same dtype: 16 weight rows k-major, the
    last zero-padded, so each k of a panel is two float32 vectors once widened."""
    n, k = weight.shape
    panels = -(-n // PANEL_ROWS)
    padded = torch.zeros(panels * PANEL_ROWS, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(panels, PANEL_ROWS, k).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """to_panels' inverse: the [N, K] weight."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def widened_linear(x: torch.Tensor, panels: torch.Tensor, n: int, scale: torch.Tensor | None,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """csrc/linear_widen.c: float32 x [..., K] times n weight rows in panels (to_panels), bf16 (scale None) or int8
    with a float32 scale per row; any row count."""
    k = panels.shape[1]
    lead = x.shape[:-1]
    x2 = rows_2d(x, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        lib, b, threads = widen_kernel(), None if bias is None else bias.data_ptr(), torch.get_num_threads()
        if scale is None:
            lib.linear_widen(x2.data_ptr(), x2.stride(0), panels.data_ptr(), b, y.data_ptr(), n, m, n, k, threads)
        else:
            lib.linear_widen_i8(x2.data_ptr(), x2.stride(0), panels.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                m, n, k, threads)
    return y.view(*lead, n)


def widen_graph_call(panels: torch.Tensor, n: int, scale: torch.Tensor | None,
                     bias: torch.Tensor | None) -> GraphCall | None:
    """csrc/linear_widen.c's graph entry over n weight rows in panels, bf16 (scale None) or int8 with float32 row
    scales."""
    if bias is not None and bias.dtype != torch.float32:
        return None
    run = ctypes.cast(widen_kernel().widen_graph_linear, ctypes.c_void_p).value
    return GraphCall(run, panels.data_ptr(), None if scale is None else scale.data_ptr(),
                     None if bias is None else bias.data_ptr(), 0, 0, n, panels.shape[1], WIDEN_MAX_ROWS)


class WidenPacking:
    """bf16 weights for float32 activations: csrc/linear_widen.c over the weight in k-major panels at every row
    count (each weight read from memory once a step, two bytes; at 512-2048 rows on par with or ahead of the
    float32 BLAS over a widened copy). Built from a float32 tensor holding bf16 values (a bf16 checkpoint loaded in
    float32), so storing it in bf16 loses nothing."""

    name = "widen"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight = to_panels(weight.to(torch.bfloat16))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return widened_linear(x, self.weight, self.out_features, None, bias)

    def graph_call(self, bias: torch.Tensor | None) -> GraphCall | None:
        return widen_graph_call(self.weight, self.out_features, None, bias)


PACKINGS = {p.name: p for p in (KernelPacking, OneDnnPacking, WidenPacking, PlainWeight)}


class PackedLinear(FormatLinear):
    """A linear in the model's dtype: loads into a plain weight, then (finish_loading) packs it for `packing`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_sizes: list[int] | None,
                 packing: type):
        super().__init__(in_features, out_features, bias, shard_sizes)
        if packing is KernelPacking and in_features % 2:  # the kernel takes k in pairs
            packing = OneDnnPacking if can_use_onednn(torch.get_default_device(), torch.get_default_dtype()) else PlainWeight
        self.packing = packing
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.dtype_bytes = self.weight.element_size()
        self._loads(self.weight, self.load_weight)
        self.packed: PlainWeight | OneDnnPacking | KernelPacking | None = None

    @property
    def backend(self) -> str:
        return self.packing.name

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        copy_checked(param.data[self.rows(shard)], tensor)

    def finish_loading(self) -> None:
        self.packed = self.packing(self.weight.detach())
        self.dtype_bytes = self.packed.weight.element_size()  # what a step reads a weight as (bf16 when widened)
        if self.packing is not PlainWeight:
            del self.weight  # the packed copy replaces it

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str) -> PackedLinear:
        """A loaded PackedLinear holding `linear`'s weight and bias, packed for `backend` ("cpu", "onednn", "torch")."""
        w = linear.weight.detach()
        with torch.device(w.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(w.dtype)
            try:
                packed = cls(linear.in_features, linear.out_features, linear.bias is not None, None, PACKINGS[backend])
            finally:
                torch.set_default_dtype(prev)
        packed.load_weight(packed.weight, w)
        if linear.bias is not None:
            packed.load_bias(packed.bias, linear.bias.detach())
        packed.finish_loading()
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.forward(x, self.bias)

    @property
    def nbytes(self) -> int:
        return formats.weight_format(None).linear(self.out_features, self.in_features, self.dtype_bytes) + self.bias_bytes()

    def describe(self) -> str:
        return f"backend={self.backend}"

    def graph_calls(self) -> list[GraphCall] | None:
        if self.packed is None or self.packed.weight.device.type != "cpu":
            return None
        call = self.packed.graph_call(self.bias)
        return None if call is None else [call]


class DenseFormat(WeightFormat):
    """No quantization: the checkpoint's weights in the model's dtype, packed for one of the PACKINGS."""

    name = None

    def __init__(self, packing: type):
        self.packing = packing
        self.shares_tied_embedding = packing is PlainWeight  # nothing to pack: the head reads the table itself

    @classmethod
    def resolve(cls, backend: str, device: torch.device, dtype: torch.dtype,
                stored: torch.dtype | None = None) -> DenseFormat:
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and linear_kernel() is not None
        widen = (device.type == "cpu" and dtype == torch.float32 and stored == torch.bfloat16
                 and widen_kernel() is not None)
        if backend == "cpu" and not (cpu_bf16 or widen):
            raise ValueError("linear_backend 'cpu' needs a CPU device, a C compiler and either bf16 weights with "
                             "AVX-512 BF16, or a bf16 checkpoint computed in float32 with AVX2")
        if backend == "onednn" and not can_use_onednn(device, dtype):
            raise ValueError("linear_backend 'onednn' needs a CPU device, bf16 weights and oneDNN bf16 kernels")
        if backend == "cpu":
            backend = "cpu" if cpu_bf16 else "widen"
        if backend == "auto":
            backend = ("cpu" if cpu_bf16 else "onednn" if can_use_onednn(device, dtype)
                       else "widen" if widen else "torch")
        return cls(PACKINGS[backend])

    def linear(self, in_features: int, out_features: int, bias: bool,
               shard_sizes: list[int] | None = None) -> PackedLinear:
        return PackedLinear(in_features, out_features, bias, shard_sizes, self.packing)


def resolve_linear_backend(backend: str, device: torch.device | str, dtype: torch.dtype,
                           stored: torch.dtype | None = None) -> str:
    """What `backend` means here for unquantized weights stored in `stored` (default: `dtype`): "cpu", "onednn",
    "widen" or "torch"; errors if it cannot run."""
    from twospeed.model.weight_format import make_weight_format

    return make_weight_format(None, backend, device, dtype, stored).packing.name
