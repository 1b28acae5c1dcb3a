"""Bytes the planner prices for each weight and KV format, without torch: the engine's own tables.

The roofline reads every weight and the attended KV once per decode step, and the KV pool holds
memory / bytes-per-token tokens, so these numbers set both decode's floor and a replica's capacity. The formats
and their bytes per weight / per cached element are schema/formats.py's, the tables the engine's weight formats
and KV pool count themselves by, so a new format reaches the planner by being added there. As in the engine,
every linear is stored in the format, the output head among them (weight-only: the matmuls still run at the
activation dtype's FLOP/s); the embedding and norms keep the model's dtype, and a quantized head is a copy
beside a tied embedding, not the embedding itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twospeed.schema import formats
from twospeed.plan.roofline import dtype_bytes, layer_linear_params, param_count

if TYPE_CHECKING:
    from twospeed.config import ModelConfig


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str | None = None) -> int:
    """Bytes of every weight as held: the linears and the output head in their format, the rest in the model's
    dtype (a quantized head beside the embedding it was made from)."""
    elem = dtype_bytes(dtype)
    fmt = formats.weight_format(quantization)
    if fmt.per_weight is None:
        return param_count(cfg) * elem
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    layer = fmt.linear(q + 2 * kv, h, elem) + fmt.linear(h, q, elem) + fmt.linear(2 * i, h, elem) + fmt.linear(h, i, elem)
    head = fmt.linear(cfg.vocab_size, h, elem)
    embed = cfg.vocab_size * h  # elements of the embedding table (and of an untied head)
    rest = param_count(cfg) - cfg.num_layers * layer_linear_params(cfg) - embed * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * layer + head + (embed + rest) * elem


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token, every layer, scales included."""
    return formats.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype, dtype_bytes(dtype))
