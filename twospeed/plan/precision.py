"""Bytes per weight and per cached element in each format the planner can price, without torch.

The roofline reads every weight and the attended KV once per decode step, and the KV pool holds
memory / bytes-per-token tokens, so these numbers set both decode's floor and a replica's capacity. The names are
the engine's options: `quantization` (weights: None = the checkpoint's dtype, "int8", "fp8": one byte a weight
plus a float32 scale per output row, weight-only, so the matmuls still run at the activation dtype's FLOP/s) and
`kv_cache_dtype` ("auto" = the model's dtype, "int8": one byte an element plus a bf16 scale per token and KV head,
"fp8": one byte, unscaled). Only the linears are quantized; embeddings, the output head and norms keep the
model's dtype. Keep these in step with the engine's weight and KV formats: this table is the seam a new format
goes through to reach the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from twospeed.plan.roofline import dtype_bytes, layer_linear_params, param_count

if TYPE_CHECKING:
    from twospeed.config import ModelConfig


@dataclass(frozen=True, slots=True)
class WeightFormat:
    per_weight: float | None  # bytes a weight; None: the model's dtype
    per_row: int = 0  # bytes per output row (scales)


@dataclass(frozen=True, slots=True)
class KVFormat:
    per_elem: int | None  # bytes a cached element; None: the model's dtype
    per_head: int = 0  # bytes per (token, KV head) for each of K and V (scales)


WEIGHT_FORMATS = {None: WeightFormat(None), "int8": WeightFormat(1, 4), "fp8": WeightFormat(1, 4)}
KV_FORMATS = {"auto": KVFormat(None), "int8": KVFormat(1, 2), "fp8": KVFormat(1)}


def weight_format(quantization: str | None) -> WeightFormat:
    if quantization not in WEIGHT_FORMATS:
        raise ValueError(f"quantization must be one of int8, fp8 (or none), got {quantization!r}")
    return WEIGHT_FORMATS[quantization]


def kv_format(kv_cache_dtype: str) -> KVFormat:
    if kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_FORMATS)}, got {kv_cache_dtype!r}")
    return KV_FORMATS[kv_cache_dtype]


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str | None = None) -> int:
    """Bytes of every weight as stored: the linears in their format, everything else in the model's dtype."""
    elem = dtype_bytes(dtype)
    fmt = weight_format(quantization)
    linear = cfg.num_layers * layer_linear_params(cfg)
    rest = param_count(cfg) - linear
    if fmt.per_weight is None:
        return (linear + rest) * elem
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = cfg.num_layers * (q + 2 * kv + h + 2 * cfg.intermediate_size + h)  # output rows of the linears
    return int(linear * fmt.per_weight) + rows * fmt.per_row + rest * elem


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token, every layer, scales included."""
    fmt = kv_format(kv_cache_dtype)
    per = dtype_bytes(dtype) if fmt.per_elem is None else fmt.per_elem
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * per + fmt.per_head)
