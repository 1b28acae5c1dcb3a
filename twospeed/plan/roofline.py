"""Roofline cost model: FLOPs of a prefill chunk, bytes of a decode step, KV bytes per token.

Why: prefill time is about FLOPs / peak FLOP/s and decode time about bytes moved / bandwidth,
so these counts (and nothing else about the model) set both speeds' floors. The planner's
simulator and the efficiency report (achieved FLOP/s / measured matmul peak, weight bytes/s /
measured bandwidth) reuse these functions.

Counting rules, as a FLOP counter over the forward pass would count them:
- a matmul is 2 FLOP per multiply-add; bias adds, norms, RoPE, activations and softmax are free;
- attention is QK^T plus PV over the (query, key) pairs the causal mask (and sliding window)
  keeps: 4 * num_heads * head_dim FLOP per pair per layer;
- only the rows that sample go through the vocabulary matmul (as twospeed's runner does);
- a decode step reads every weight once (the embedding table only in the rows it looks up,
  unless it is tied to the output head, which reads it all) plus the K and V of every
  position each sequence attends to, and writes one position of K and V per sequence.

Inputs are a `ModelConfig` (model/loader.py reads it from config.json); no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twospeed.schema import formats

if TYPE_CHECKING:
    from twospeed.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name ("bfloat16") or a torch.dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        return DTYPE_BYTES[dtype]
    return int(dtype.itemsize)


def dtype_name(dtype: Any) -> str:
    """"bfloat16" for torch.bfloat16 or "bfloat16"."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


# -- sizes ------------------------------------------------------------------------------------------
def layer_linear_params(cfg: ModelConfig) -> int:
    """Weight elements of one decoder layer's matmuls (q, k, v, o projections and the SwiGLU MLP)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size


def param_count(cfg: ModelConfig) -> int:
    """Every parameter of the checkpoint (biases and QK-norm weights included; a tied embedding once)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = layer_linear_params(cfg) + 2 * h  # + the two RMSNorm weights
    layer += (q + 2 * kv) * cfg.qkv_bias + h * cfg.o_bias + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    layer += 2 * cfg.head_dim * cfg.qk_norm
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * layer + embed + h  # + the final norm


def param_bytes(cfg: ModelConfig, bytes_per_param: int) -> int:
    return param_count(cfg) * bytes_per_param


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_param: int, kv_cache_dtype: str = "auto") -> int:
    """K and V of one position, every layer, scales included (schema/formats.py's count): what each cached token
    costs in memory and in every decode read."""
    return formats.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype, bytes_per_param)


# -- FLOPs ------------------------------------------------------------------------------------------
def attention_pairs(num_tokens: int, context_len: int = 0, sliding_window: int | None = None) -> int:
    """(query, key) pairs a causal chunk computes: query i (position context_len + i) sees keys
    0..context_len + i, or the last `sliding_window` of them."""
    if num_tokens < 0 or context_len < 0:
        raise ValueError(f"num_tokens and context_len must be >= 0, got {num_tokens}, {context_len}")

    def keys_upto(p: int) -> int:  # sum over positions 0..p-1 of the keys each sees
        if sliding_window is None or p <= sliding_window:
            return p * (p + 1) // 2
        w = sliding_window
        return w * (w + 1) // 2 + (p - w) * w

    return keys_upto(context_len + num_tokens) - keys_upto(context_len)


@dataclass(frozen=True, slots=True)
class Flops:
    """FLOPs of one forward chunk, by where they are spent."""

    linear: int  # q/k/v/o projections and MLP, every layer
    attention: int  # QK^T and PV over the causal pairs
    logits: int  # the vocabulary matmul of the rows that sample

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.logits


def prefill_flops(cfg: ModelConfig, num_tokens: int, context_len: int = 0, sampled_rows: int = 1) -> Flops:
    """FLOPs of a prefill chunk of `num_tokens` new tokens after `context_len` tokens already in the KV cache
    (a prefix-cache hit or earlier chunks). `sampled_rows`: 1 for a prompt's last chunk, 0 for others."""
    if num_tokens < 1:
        raise ValueError(f"a prefill chunk needs at least one token, got {num_tokens}")
    pairs = attention_pairs(num_tokens, context_len, cfg.sliding_window)
    return Flops(linear=2 * num_tokens * cfg.num_layers * layer_linear_params(cfg),
                 attention=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs,
                 logits=2 * sampled_rows * cfg.hidden_size * cfg.vocab_size)


def decode_step_flops(cfg: ModelConfig, context_lens: Sequence[int]) -> Flops:
    """FLOPs of one decode step: one new token per sequence, each after `context_lens[i]` cached tokens."""
    b = len(context_lens)
    pairs = sum(attention_pairs(1, c, cfg.sliding_window) for c in context_lens)
    return Flops(linear=2 * b * cfg.num_layers * layer_linear_params(cfg),
                 attention=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs,
                 logits=2 * b * cfg.hidden_size * cfg.vocab_size)


# -- bytes ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepBytes:
    """Memory traffic of one decode step."""

    weights: int  # every weight read once
    kv_read: int  # K and V of every position attended
    kv_write: int  # K and V of each new token

    @property
    def total(self) -> int:
        return self.weights + self.kv_read + self.kv_write


def decode_weight_bytes(cfg: ModelConfig, batch: int, bytes_per_param: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads: all of them, except that an untied
    embedding table is read only in the `batch` rows it looks up."""
    total = param_bytes(cfg, bytes_per_param)
    if not cfg.tie_word_embeddings:
        total -= (cfg.vocab_size - batch) * cfg.hidden_size * bytes_per_param
    return total


def decode_step_bytes(cfg: ModelConfig, context_lens: Sequence[int], bytes_per_param: int,
                      kv_cache_dtype: str = "auto") -> StepBytes:
    """Bytes of one decode step for a batch whose sequences hold `context_lens[i]` cached tokens each
    (each attends to those plus its new token, the last `sliding_window` only when the model has one)."""
    if not context_lens:
        raise ValueError("a decode step needs at least one sequence")
    if min(context_lens) < 0:
        raise ValueError(f"context lengths must be >= 0, got {min(context_lens)}")
    per_token = kv_bytes_per_token(cfg, bytes_per_param, kv_cache_dtype)
    window = cfg.sliding_window
    attended = sum(c + 1 if window is None else min(c + 1, window) for c in context_lens)
    return StepBytes(weights=decode_weight_bytes(cfg, len(context_lens), bytes_per_param),
                     kv_read=attended * per_token, kv_write=len(context_lens) * per_token)


# -- one request on one machine ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CaseRoofline:
    """Roofline floor of one request shape (`batch` identical requests decoding together)."""

    prompt_tokens: int
    output_tokens: int
    batch: int
    prefill_flops: int  # one request's whole prompt in one chunk
    prefill_s: float  # prefill_flops / peak FLOP/s
    decode_steps: int  # output_tokens - 1: the first token comes out of prefill
    decode_bytes_first: int  # bytes of the first decode step (the whole batch)
    decode_bytes_last: int
    decode_bytes: int  # all decode steps
    decode_s: float  # decode_bytes / bandwidth
    itl_s: float  # decode_s / decode_steps: the per-token floor
    kv_bytes_per_token: int
    kv_bytes: int  # KV the batch holds at the end

    def to_dict(self) -> dict:
        return asdict(self)


def roofline_case(cfg: ModelConfig, peak_flops: float, bandwidth: float, prompt_tokens: int, output_tokens: int,
                  batch: int = 1, bytes_per_param: int = 2, kv_cache_dtype: str = "auto") -> CaseRoofline:
    """Prefill as compute-bound and decode as bandwidth-bound, each at its own roof."""
    if prompt_tokens < 1 or output_tokens < 1 or batch < 1:
        raise ValueError("prompt_tokens, output_tokens and batch must be >= 1")
    if peak_flops <= 0 or bandwidth <= 0:
        raise ValueError("peak FLOP/s and bandwidth must be positive")
    flops = prefill_flops(cfg, prompt_tokens).total
    steps = output_tokens - 1
    # Step k (1..steps) feeds the token at position prompt + k - 1: prompt + k - 1 tokens are cached.
    step_bytes = [decode_step_bytes(cfg, [prompt_tokens + k - 1] * batch, bytes_per_param, kv_cache_dtype).total
                  for k in range(1, steps + 1)]
    total = sum(step_bytes)
    per_token = kv_bytes_per_token(cfg, bytes_per_param, kv_cache_dtype)
    return CaseRoofline(prompt_tokens, output_tokens, batch, flops, flops / peak_flops, steps,
                        step_bytes[0] if steps else 0, step_bytes[-1] if steps else 0, total, total / bandwidth,
                        total / bandwidth / steps if steps else 0.0, per_token,
                        per_token * batch * (prompt_tokens + output_tokens - 1))


def load_config(model: str) -> ModelConfig:
    """ModelConfig of a built-in model ("demo", ...), an HF checkpoint folder, a config.json path or a GGUF file
    (weights are not read)."""
    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin
    from twospeed.model.checkpoint_files import is_checkpoint_path
    from twospeed.model.loader import load_model_config

    if is_builtin(model):
        return load_model_config(builtin_checkpoint_path(model))
    path = Path(model)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not is_checkpoint_path(path):
        raise ValueError(f"model {model!r}: not 'demo' or another built-in model, a checkpoint folder, "
                         "a config.json file or a .gguf file")
    return load_model_config(path)
