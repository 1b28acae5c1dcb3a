"""Block-quantized weight formats kept packed: `q8_0`, `q4_0`, `q4_1`, `q4_k` (GGUF's layouts) and `gguf`.

A decode step reads every weight once, so a 4-bit format reads a quarter of bf16's bytes (an eighth of float32's).
Each linear keeps its weight in GGUF's block layout (model/block_kinds.py): rows of blocks along the input, so a
tensor a GGUF file holds in that layout is used byte for byte, and one from a bf16/fp32 checkpoint is quantized
on arrival (as int8 is, model/quant.py). Formats (`quantization`):

- `q8_0`, `q4_0`, `q4_1`, `q4_k`: every linear in that layout. A GGUF tensor stored in it is taken as stored;
  a tensor stored otherwise (floats, another block type) is dequantized exactly and quantized into it. `q4_k`
  needs inputs that are a multiple of 256: a linear whose input is not (SmolLM2's 576) is stored in q4_0, the
  same bytes a weight (llama.cpp falls back to Q5_0 there, which has no kernel here).
- `gguf`: a GGUF file as stored, what llama.cpp runs: each tensor keeps its own block type where it is one of
  the four above or Q6_K (which llama.cpp's Q4_K_M files hold beside Q4_K); a tensor in any other type
  (F16/BF16/F32, Q5_*, ...) is quantized to q8_0 from its exact values (error <= 1/254 of each block's largest
  weight). A fused linear (q/k/v, gate/up) whose tensors differ keeps one part per type and runs one kernel call
  per part.
- every linear's input must be a multiple of 32 (a block): anything else is refused when the model is built.

Two paths behind `BlockLinear.forward`, tested against each other and a float64 reference
(tests/model/test_block_quant.py):
- float32 or bf16 activations on a CPU with AVX2 + FMA + F16C, any number of rows (decode steps, prompt chunks):
  csrc/linear_qblock.c, llama.cpp's way: activations quantized to int8 per block of 32, integer dot products
  against each weight block, read from memory once per call. Bound per output: sum over blocks of max|x_b| / 254
  times sum_b |w| (the activations' rounding), plus float32 summation. Where it runs, every part holds its rows
  grouped by 8 (BlockKind.group_rows: the same bytes in the kernel's order; `BlockPart.gguf_rows` gives GGUF's
  back). Prompt chunks take it too: it beat dequantizing the weights each call for torch's float32 BLAS at every
  row count measured (BENCHMARKS.md, block formats).
- anywhere else (any device, any dtype: the portable path the kernel is checked against): dequantize in torch,
  F.linear in float32, one rounding to the activations' dtype.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from twospeed.model.block_kinds import KINDS, BlockKind, BlockTensor
from twospeed.model.cbuild import load_library
from twospeed.model.packed_linear import rows_2d
from twospeed.model.weight_format import FormatLinear, GraphCall, ShapeMismatch, WeightFormat

QBLOCK_MAX_ROWS = 1 << 30  # rows the kernel takes in a call: any (the decode graph asks)
KIND_X8 = 8  # csrc/linear_qblock.c: a part's rows grouped by 8 (BlockKind.group_rows)
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@lru_cache(maxsize=1)
def qblock_kernel() -> ctypes.CDLL | None:
    """csrc/linear_qblock.c, built on first use (model/cbuild.py); None without a compiler or AVX2 + FMA + F16C."""
    lib = load_library("linear_qblock", {})
    if lib is not None:
        lib.linear_qblock.argtypes = [_P, _L, _I, _P, _I, _P, _P, _L, _I, _I, _I, _I]
        lib.linear_qblock.restype = ctypes.c_int
    return lib


@dataclass(slots=True)
class BlockPart:
    """Output rows `rows` of a linear, stored in one block kind: data uint8 [rows, row_bytes], in GGUF's layout or,
    `grouped`, in the kernel's (BlockKind.group_rows: the same bytes, 8 rows interleaved)."""

    rows: slice
    kind: BlockKind
    data: torch.Tensor
    grouped: bool = False

    @property
    def code(self) -> int:
        """csrc/linear_qblock.c's kind for these bytes (KIND_X8 or'ed in where grouped)."""
        return self.kind.code | (KIND_X8 if self.grouped else 0)

    def gguf_rows(self) -> torch.Tensor:
        """The bytes in GGUF's layout (a copy where grouped)."""
        return self.kind.ungroup_rows(self.data) if self.grouped else self.data


class BlockFormat(WeightFormat):
    """Weights in GGUF block layouts. Subclasses say which kind a linear stores and which kinds it keeps as read."""

    kind: BlockKind | None = None  # the layout every linear is stored in

    def __init__(self, use_kernel: bool):
        self.use_kernel = use_kernel  # csrc/linear_qblock.c (CPU, AVX2 + FMA + F16C)

    @classmethod
    def resolve(cls, backend: str, device: torch.device, dtype: torch.dtype,
                stored: torch.dtype | None = None) -> BlockFormat:
        if backend == "onednn":
            raise ValueError(f"quantization {cls.name!r} has no oneDNN path: linear_backend 'auto', 'cpu' or 'torch'")
        kernel = device.type == "cpu" and qblock_kernel() is not None
        if backend == "cpu" and not kernel:
            raise ValueError(f"linear_backend 'cpu' with quantization {cls.name!r} needs a CPU device, a C compiler "
                             "and AVX2 + FMA + F16C")
        return cls(use_kernel=kernel and backend != "torch")

    def linear(self, in_features: int, out_features: int, bias: bool,
               shard_sizes: list[int] | None = None) -> BlockLinear:
        return BlockLinear(self, in_features, out_features, bias, shard_sizes)

    def kind_for(self, in_features: int) -> BlockKind:
        """The layout a linear of `in_features` inputs stores what arrives as floats (or in a kind it does not keep)."""
        return self._fitting(self.kind, in_features)

    def _fitting(self, kind: BlockKind, in_features: int) -> BlockKind:
        if not kind.fits(in_features):
            raise ValueError(f"quantization {self.name!r} stores weights in blocks of {kind.block} along the input: "
                             f"a linear of {in_features} inputs cannot be (int8 or no quantization can)")
        return kind

    def keeps(self, kind: BlockKind) -> bool:
        """Whether a tensor read in `kind` is kept as read (else dequantized and quantized into kind_for)."""
        return kind is self.kind


class Q8_0Format(BlockFormat):
    name, kind = "q8_0", KINDS["Q8_0"]


class Q4_0Format(BlockFormat):
    name, kind = "q4_0", KINDS["Q4_0"]


class Q4_1Format(BlockFormat):
    name, kind = "q4_1", KINDS["Q4_1"]


class Q4KFormat(BlockFormat):
    """Q4_K where the input is a multiple of 256, else Q4_0 (the same bytes a weight)."""

    name, kind = "q4_k", KINDS["Q4_K"]

    def kind_for(self, in_features: int) -> BlockKind:
        return self.kind if self.kind.fits(in_features) else self._fitting(KINDS["Q4_0"], in_features)


class GGUFFormat(BlockFormat):
    """A GGUF file as stored: every block kind with a kernel kept as read, anything else in q8_0."""

    name, kind = "gguf", KINDS["Q8_0"]

    def keeps(self, kind: BlockKind) -> bool:
        return True


FORMATS: dict[str, type[BlockFormat]] = {f.name: f for f in (Q8_0Format, Q4_0Format, Q4_1Format, Q4KFormat,
                                                             GGUFFormat)}


class BlockLinear(FormatLinear):
    """A linear whose weight stays in block layouts: loaded as a GGUF file stores it or quantized on arrival;
    forward through csrc/linear_qblock.c where it runs, else the portable float32 path."""

    def __init__(self, fmt: BlockFormat, in_features: int, out_features: int, bias: bool,
                 shard_sizes: list[int] | None = None):
        super().__init__(in_features, out_features, bias, shard_sizes)
        self.fmt, self.kind = fmt, fmt.kind_for(in_features)
        # uninitialized: the loader checks every shard arrives (and rows another kind keeps are never touched)
        self.weight = nn.Parameter(torch.empty(out_features, self.kind.row_bytes(in_features), dtype=torch.uint8),
                                   requires_grad=False)
        self._loads(self.weight, self.load_weight)
        self.weight.takes_blocks = True  # the loader hands this parameter a file's packed bytes where it has them
        self._kept: dict[int | None, BlockPart] = {}  # shards kept in another kind than self.kind (gguf)
        self.parts: list[BlockPart] = []
        self.bias32: torch.Tensor | None = None

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor | BlockTensor, shard: int | None = None) -> None:
        rows = self.rows(shard)
        if tuple(tensor.shape) != (rows.stop - rows.start, self.in_features):
            raise ShapeMismatch((rows.stop - rows.start, self.in_features))
        self._kept.pop(shard, None)
        if isinstance(tensor, BlockTensor):
            if tensor.kind is self.kind:  # byte for byte
                param.data[rows] = tensor.data.to(param.device)
                return
            if self.fmt.keeps(tensor.kind):
                self._kept[shard] = BlockPart(rows, tensor.kind, tensor.data.to(param.device).contiguous())
                return
            tensor = tensor.dequantize()
        param.data[rows] = self.kind.quantize(tensor.to(param.device))

    def finish_loading(self) -> None:
        shards = [None] if self.shard_sizes is None else range(len(self.shard_sizes))
        runs: list[tuple[BlockKind, list[BlockPart]]] = []  # consecutive shards of one kind
        for shard in shards:
            piece = self._kept.get(shard) or BlockPart(self.rows(shard), self.kind, None)
            if runs and runs[-1][0] is piece.kind:
                runs[-1][1].append(piece)
            else:
                runs.append((piece.kind, [piece]))
        own = len(runs) == 1 and all(p.data is None for p in runs[0][1])
        self.parts = [BlockPart(slice(pieces[0].rows.start, pieces[-1].rows.stop), kind,
                                self.weight.data if own else
                                torch.cat([self.weight.data[p.rows] if p.data is None else p.data for p in pieces]))
                      for kind, pieces in runs]
        self._kept = {}
        if self.fmt.use_kernel:  # the decode kernel reads 8 rows' blocks at once: group them in place of GGUF's rows
            for part in self.parts:
                if part.kind.x8_fields and part.data.device.type == "cpu":
                    part.data, part.grouped = part.kind.group_rows(part.data), True
            if own:
                self.weight.data = self.parts[0].data
        if not own:
            del self.weight  # the parts hold every row
        if self.bias is not None:
            self.bias32 = self.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt.use_kernel and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return self.kernel(x)
        return self.portable(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """csrc/linear_qblock.c, one call per part (each writes its columns of y)."""
        lead = x.shape[:-1]
        x2 = rows_2d(x, self.in_features)
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=x.dtype, device=x.device)
        if m:
            lib, threads, bf16 = qblock_kernel(), torch.get_num_threads(), int(x.dtype == torch.bfloat16)
            for part in self.parts:
                start, rows = part.rows.start, part.rows.stop - part.rows.start
                bias = None if self.bias32 is None else self.bias32.data_ptr() + 4 * start
                if lib.linear_qblock(x2.data_ptr(), x2.stride(0), bf16, part.data.data_ptr(), part.code, bias,
                                     y[:, start:].data_ptr(), y.stride(0), m, rows, self.in_features, threads):
                    raise MemoryError(f"linear_qblock: no memory for {m} x {self.in_features} quantized activations")
        return y.view(*lead, self.out_features)

    def portable(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear in float32 over the dequantized weight, one rounding to x's dtype: the reference path."""
        y = F.linear(x.float(), self.dequantized().to(x.device))
        if self.bias is not None:
            y += self.bias.float()
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] these bytes stand for (gguf's dequantization)."""
        parts = self.parts or [BlockPart(slice(0, self.out_features), self.kind, self.weight.data)]
        return torch.cat([p.kind.dequantize(p.gguf_rows(), self.in_features) for p in parts])

    def graph_calls(self) -> list[GraphCall] | None:
        """csrc/linear_qblock.c's graph entry, one call per part."""
        if not self.fmt.use_kernel or not self.parts or self.parts[0].data.device.type != "cpu":
            return None
        run = ctypes.cast(qblock_kernel().qblock_graph_linear, ctypes.c_void_p).value
        return [GraphCall(run, p.data.data_ptr(), None,
                          None if self.bias32 is None else self.bias32.data_ptr() + 4 * p.rows.start,
                          p.rows.start, p.code, p.rows.stop - p.rows.start, self.in_features, QBLOCK_MAX_ROWS)
                for p in self.parts]

    @property
    def nbytes(self) -> int:
        held = sum(p.data.numel() for p in self.parts) if self.parts else self.weight.numel()
        return held + self.bias_bytes()

    def describe(self) -> str:
        kinds = "+".join(dict.fromkeys(p.kind.name for p in self.parts)) or self.kind.name
        return f"format={self.fmt.name} ({kinds}), {'C kernel' if self.fmt.use_kernel else 'portable'}"
