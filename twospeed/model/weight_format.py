"""The interface every weight format implements, and how a format is picked from the engine's options.

A `WeightFormat` makes the model's linears (`fmt.linear(in, out, bias)`): one module class per format, each
owning its tensors, so the model file has no quantization branches (gpt-fast's module swap). Each of a
linear's parameters carries a `weight_loader(param, tensor, shard)` (nano-vllm's idea), so the checkpoint
loader only maps names: a dense linear copies the tensor (into its shard's rows when q/k/v or gate/up are
fused), an int8 linear quantizes it on arrival and keeps the bytes and the scales. After the last tensor,
`finish_loading()` lets a linear pack itself for its kernel. Every linear knows its `nbytes`, what a decode
step reads for it (counted by the torch-free rules in schema/formats.py).

Formats: the checkpoint's dtype (model/packed_linear.py: `DenseFormat`), `int8` and `fp8`
(model/quant.py), GGUF's block layouts kept packed, `q8_0`, `q4_0`, `q4_1`, `q4_k` and a GGUF file's own
(`gguf`) (model/block_quant.py), and two deliberately destructive test-only formats the gate's tests use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from twospeed.schema import formats

LINEAR_BACKENDS = ("auto", "cpu", "onednn", "torch")  # "cpu" means the widening kernel where it applies


class ShapeMismatch(ValueError):
    """A checkpoint tensor does not fit the parameter (the loader names the file and tensor)."""

    def __init__(self, expected: tuple[int, ...]):
        super().__init__(f"expected shape {tuple(expected)}")
        self.expected = tuple(expected)


def copy_checked(dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ShapeMismatch(tuple(dest.shape))
    dest.copy_(tensor)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
    """For parameters no format owns (norms, the embedding): copy, checking the shape."""
    copy_checked(param.data, tensor)


@dataclass(frozen=True, slots=True)
class GraphCall:
    """One C kernel call computing columns [col, col + out_features) of a linear for float32 activations, as the
    decode graph runs it (csrc/graph.h's GraphLinear; model/decode_graph.py): addresses of the kernel's graph
    entry and of the tensors it reads, which the linear keeps alive."""

    run: int  # the kernel's `int run(const GraphLinear *, x, ldx, y, ldy, M, threads)`
    weight: int
    scale: int | None  # a float32 scale per output row
    bias: int | None  # float32, from this call's first column
    col: int
    kind: int  # the kernel's own variant (a block kind's code)
    out_features: int
    in_features: int
    max_rows: int  # the most activation rows the kernel takes


class FormatLinear(nn.Module):
    """y = x W^T + b for inference, in some weight format. `shard_sizes` are the output rows of each checkpoint
    tensor fused into this one (q, k, v or gate, up), in shard order; None for an unfused linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard_sizes: list[int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if shard_sizes is not None and sum(shard_sizes) != out_features:
            raise ValueError(f"shard sizes {shard_sizes} do not add up to {out_features} output rows")
        self.shard_sizes = shard_sizes
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        if self.bias is not None:
            self._loads(self.bias, self.load_bias)

    def _loads(self, param: nn.Parameter, loader) -> None:
        """Mark `param` as loaded by `loader`, shard by shard when this linear is fused."""
        param.weight_loader = loader
        param.num_shards = None if self.shard_sizes is None else len(self.shard_sizes)

    def rows(self, shard: int | None) -> slice:
        """The output rows a checkpoint shard fills (all of them for an unfused linear)."""
        if shard is None:
            return slice(0, self.out_features)
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])

    def load_bias(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        copy_checked(param.data[self.rows(shard)], tensor)

    def load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard: int | None = None) -> None:
        """The weight's weight_loader: store the checkpoint tensor (rows of `shard`) in this format."""
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Called once after every tensor is loaded: pack for a kernel, free what is no longer needed."""

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads for this linear: weights, scales and bias."""
        raise NotImplementedError

    def bias_bytes(self) -> int:
        return 0 if self.bias is None else self.bias.numel() * self.bias.element_size()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.describe()}")

    def describe(self) -> str:
        return ""

    def graph_calls(self) -> list[GraphCall] | None:
        """The C calls computing this linear for float32 activations on CPU, for the decode graph
        (model/decode_graph.py); None where it has no such kernel (the graph then stays off)."""
        return None


class WeightFormat(ABC):
    """One way to store and multiply a model's weights; makes every linear of the model."""

    name: str | None = None  # the `quantization` value (None: the checkpoint's dtype)
    shares_tied_embedding = False  # a tied output head may reuse the embedding table itself

    @classmethod
    @abstractmethod
    def resolve(cls, backend: str, device: torch.device, dtype: torch.dtype,
                stored: torch.dtype | None = None) -> WeightFormat:
        """This format on `device` for `dtype` activations with `linear_backend` = backend, the checkpoint's weights
        stored in `stored` (None: `dtype`); errors if it cannot run."""

    @abstractmethod
    def linear(self, in_features: int, out_features: int, bias: bool,
               shard_sizes: list[int] | None = None) -> FormatLinear:
        """A linear of this format (built under the model's default device and dtype)."""

    def weight_nbytes(self, out_features: int, in_features: int, dtype: torch.dtype) -> int:
        return formats.weight_format(self.name).linear(out_features, in_features, dtype.itemsize)


def _formats() -> dict[str | None, type[WeightFormat]]:
    from twospeed.model.block_quant import FORMATS as BLOCK_FORMATS
    from twospeed.model.packed_linear import DenseFormat
    from twospeed.model.quant import FORMATS

    return {None: DenseFormat, **FORMATS, **BLOCK_FORMATS}


def make_weight_format(quantization: str | None, linear_backend: str, device: torch.device | str,
                       dtype: torch.dtype, stored: torch.dtype | None = None) -> WeightFormat:
    """The format for the engine's `quantization` and `linear_backend` options on this device and dtype, for a
    checkpoint whose weights are stored in `stored` (None: `dtype`)."""
    formats.weight_format(quantization)  # the name is known (the message lists what users may choose)
    if linear_backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {linear_backend!r}")
    return _formats()[quantization].resolve(linear_backend, torch.device(device), dtype, stored)
