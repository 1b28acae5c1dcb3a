"""The Llama-family decoder over a flat batch and a paged KV cache.

One module serves Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k
RMSNorm): GQA, RoPE (default, linear, llama3 scaling), RMSNorm, SwiGLU. The
reference is HF transformers' modeling_llama.py / modeling_qwen3.py; the
numerics follow it op for op (RMSNorm in float32, cos/sin cast to the model
dtype) so greedy tokens match it.

Inputs are flat: input_ids [T] and positions [T] hold every new token of the
step, whichever request it belongs to; `AttentionMetadata` says which is which.
q/k/v and gate/up are fused into one matmul each at load time. Submodules are called through
`.forward` directly: the model has no hooks, and nn.Module.__call__'s bookkeeping, ~100 calls a step, was
a measurable part of a batch-1 decode step on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from twospeed.config import ModelConfig
from twospeed.model.attention import AttentionMetadata
from twospeed.model.cpu_attention import make_attention
from twospeed.model.decode_graph import DecodeGraph
from twospeed.model.fused_ops import rms_norm, silu_mul
from twospeed.model.kv_format import KVFormat
from twospeed.model.weight_format import FormatLinear, WeightFormat


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernel = True  # the fused C op where it applies (model/fused_ops.py); False: torch ops only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, None, self.use_kernel)[0]

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the add as HF's `residual + hidden_states` (in place)."""
        return rms_norm(x, self.weight, self.eps, residual, self.use_kernel)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with the checkpoint's rope scaling applied (HF's formulas)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":  # a GGUF's rope_freqs: one divisor per frequency (llama3's scaling, precomputed)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3, freq_factors)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, looked up by index each step."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        freqs = torch.arange(max_positions).float()[:, None] * rope_inv_freq(cfg)[None, :]  # [P, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
        sin = emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        # HF's rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: the sign lives in the table
        self.register_buffer("sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [T, 1, hd], looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd] -> x * cos + rotate_half(x) * sin, exactly as HF computes it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, fmt: WeightFormat, attention_backend: str = "auto", kv: KVFormat | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = fmt.linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias,
                                   [self.q_size, self.kv_size, self.kv_size])
        self.o_proj = fmt.linear(self.q_size, cfg.hidden_size, cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # built under load_model's default device and dtype, which pick the backend
        self.attn = make_attention(attention_backend, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.sliding_window, torch.get_default_device(), torch.get_default_dtype(), kv)
        # one C pass for RoPE + cache write where the backend has it (Qwen3's q/k norms come first: not fused)
        self.fused_rope = hasattr(self.attn, "forward_fused") and self.q_norm is None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, (H + 2 KVH) * hd]
        if self.fused_rope and self.attn.fused_rope_ok(qkv):  # the CPU kernels: RoPE, cache write, attention
            o = self.attn.forward_fused(qkv, *rope, kv_cache[0], kv_cache[1], meta)
            return self.o_proj.forward(o.view(t, self.q_size))
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        if self.q_norm is None:
            # q and k heads side by side: one RoPE pass over [T, H + KVH, hd]
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(self.q_norm.forward(q), *rope), apply_rope(self.k_norm.forward(k), *rope)
        o = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], meta)  # [T, H, hd]
        return self.o_proj.forward(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fmt: WeightFormat):
        super().__init__()
        self.gate_up_proj = fmt.linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias,
                                       [cfg.intermediate_size] * 2)
        self.down_proj = fmt.linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.use_kernel = True  # fused SiLU-and-multiply where it applies (model/fused_ops.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_mul(self.gate_up_proj.forward(x), self.use_kernel))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, fmt: WeightFormat, attention_backend: str = "auto", kv: KVFormat | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, fmt, attention_backend, kv)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, fmt)

    def forward(self, x, residual, rope, kv_cache, meta):
        """x: the last layer's MLP output (the embeddings at layer 0, with residual None); returns this
        layer's MLP output and the residual stream, so each residual add fuses with the RMSNorm after it."""
        h, residual = self.input_layernorm.forward_residual(x, residual)
        h, residual = self.post_attention_layernorm.forward_residual(
            self.self_attn.forward(h, rope, kv_cache, meta), residual)
        return self.mlp.forward(h), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's, except the fused qkv_proj and gate_up_proj (see STACKED_PARAMS)."""

    # HF tensor name part -> (our fused parameter, shard index)
    STACKED_PARAMS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, attention_backend: str = "auto",
                 weight_format: WeightFormat | None = None, kv_format: KVFormat | None = None):
        super().__init__()
        from twospeed.model.packed_linear import DenseFormat, PlainWeight

        fmt = weight_format or DenseFormat(PlainWeight)
        self.cfg, self.weight_format, self.kv_format = cfg, fmt, kv_format or KVFormat()
        dtype = torch.get_default_dtype()
        self.rotary = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings, dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, fmt, attention_backend, self.kv_format)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The logits matmul is a linear of the model's format. Tied to the embedding, it either reads the table
        # itself (plain weights) or holds its own copy in its format (packed or quantized), loaded from the table.
        self.lm_head = fmt.linear(cfg.hidden_size, cfg.vocab_size, False)
        self.head_shares_embedding = cfg.tie_word_embeddings and fmt.shares_tied_embedding
        self.batch_invariant = False  # every row computed the same way whatever the step: model/batch_invariant.py
        self.decode_graph = None  # decode-only steps as one C call where every piece has a kernel (finish_loading)
        if self.head_shares_embedding:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (after the final norm)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.decode_graph is not None and self.decode_graph.takes(input_ids.shape[0], meta, kv_caches):
            return self.decode_graph.run(x, positions, meta)
        rope = self.rotary.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer.forward(x, residual, rope, kv_cache, meta)
        return self.norm.forward_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]; only rows that sample pay for the vocab matmul."""
        return self.lm_head.forward(hidden).float()

    def checkpoint_targets(self, name: str) -> list[tuple[str, int | None]]:
        """HF tensor name -> the (our parameter name, shard index or None) it loads into; none for a tensor this
        model does not keep (a tied checkpoint's stored lm_head copy)."""
        if name == "lm_head.weight":
            return [] if self.cfg.tie_word_embeddings else [(name, None)]
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight" and self.cfg.tie_word_embeddings and not self.head_shares_embedding:
            return [(name, None), ("lm_head.weight", None)]  # the head's own copy, in its format
        for part, (fused, shard) in self.STACKED_PARAMS.items():
            if f".{part}." in name:
                return [(name.replace(part, fused), shard)]
        return [(name, None)]

    def finish_loading(self) -> None:
        """After the last tensor: every linear packs itself for its kernel (model/weight_format.py), then the
        decode graph is built where every piece has a float32 C kernel (model/decode_graph.py)."""
        for m in self.modules():
            if isinstance(m, FormatLinear):
                m.finish_loading()
        self.decode_graph = DecodeGraph.build(self)

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every linear in its format (weights, scales, biases; padding not counted),
        the logits matrix among them, and the norms; the embedding is a lookup."""
        total, seen = 0, set()
        for m in self.modules():
            if isinstance(m, FormatLinear):
                total += m.nbytes
                seen |= {id(p) for p in m.parameters()}
        for name, p in self.named_parameters():
            if id(p) not in seen and not name.startswith("embed_tokens."):
                total += p.numel() * p.element_size()
        return total
