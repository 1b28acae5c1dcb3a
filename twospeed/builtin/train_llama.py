"""A training-mode Llama in plain torch, with HF LlamaForCausalLM's parameter names and layout.

Why: the built-in task model (builtin/task_model.py) is trained on first use, and transformers is only a test
dependency. The serving model (model/llama.py) is built for a paged cache and a flat batch; this one is the
textbook decoder over a padded batch [B, T], with torch's fused SDPA (causal) for attention, so training is
a few dozen lines and its `state_dict()` is exactly the tensors an HF checkpoint holds (the one loader
serves it, and a test loads it with transformers as the reference).

Numerics follow HF's modeling_llama.py: RMSNorm in float32, RoPE as rotate_half, SwiGLU, tied embeddings.
Under bf16 autocast on CPU the matmuls and attention run in bf16 (AMX/AVX-512 BF16), the rest in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twospeed.config import ModelConfig
from twospeed.model.llama import apply_rope, rope_inv_freq

SLOW_SPAN = 1024  # positions over which a built head's matching RoPE planes may turn at most one radian


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


SHORT_T = 192  # up to this many positions, attention as three plain ops beats the CPU flash kernel (2-3x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + causal mask) v for q [B, H, T, hd], k and v [B, KVH, T, hd].

    torch's fused SDPA (flash on CPU) costs about the same per token at any length (~20 us per token and
    layer fwd+bwd at 4 heads of 64), so short sequences, where the scores are small, use the plain ops."""
    t = q.shape[2]
    if t > SHORT_T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mask = torch.full((t, t), float("-inf"), device=q.device).triu_(1)
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5 + mask  # [B, H, T, T]
    return scores.softmax(-1).to(v.dtype) @ v


@dataclass(slots=True)
class AttentionProbe:
    """Supervision for some heads' attention: at query position `query` of row `batch` they should look at key
    position `target`. The forward pass fills in `loss` (mean -log attention on the targets, over the heads)
    and `output` (what those heads alone add to the residual there, for a copy loss on it).

    Why: a model this small, trained for minutes, learns what to write long before it learns where in a long
    prompt to copy it from. Telling the copy heads where the copied token sits (builtin/task_model.py finds it)
    helps copying ids, names and values from the evidence; nothing changes at inference."""

    layer: int
    heads: tuple[int, ...]  # the heads taught (each the same targets)
    batch: torch.Tensor  # [N]
    query: torch.Tensor  # [N]
    target: torch.Tensor  # [N]
    weight: torch.Tensor | None = None  # [N]: each target's share of the loss (None: alike)
    copied: int | None = None  # the first `copied` targets are copies, the rest look away (None: all copy)
    loss: torch.Tensor | None = None
    output: torch.Tensor | None = None  # [N, hidden]: what these heads alone add to the residual at `query`


def probe_loss(q: torch.Tensor, k: torch.Tensor, probe: AttentionProbe) -> torch.Tensor:
    """-log softmax(q k^T / sqrt(hd)) at the probe's targets, averaged over its heads; q [B, H, T, hd],
    k [B, KVH, T, hd]."""
    causal = torch.arange(k.shape[2], device=q.device)[None, :] > probe.query[:, None]

    def picked(head: int) -> torch.Tensor:
        kv_head = head // (q.shape[1] // k.shape[1])
        scores = q[:, head] @ k[:, kv_head].transpose(-1, -2)  # [B, T, T]: one head is cheap to spell out
        scores = scores[probe.batch, probe.query].float() * q.shape[-1] ** -0.5  # [N, T]
        logp = scores.masked_fill(causal, float("-inf")).log_softmax(-1)
        return logp.gather(1, probe.target[:, None])[:, 0]
    return probe_nll(probe, picked)


def probe_nll(probe: AttentionProbe, picked: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The probe's loss from `picked(head)`, each target's log attention in that head: -(mean, or the shares'
    weighted sum), averaged over the heads."""
    total = 0.0
    for head in probe.heads:
        logp = picked(head)
        total = total - (logp.mean() if probe.weight is None else (logp * probe.weight).sum())
    return total / len(probe.heads)


def probe_rows(probe: AttentionProbe, rows: torch.Tensor, t: int) -> torch.Tensor:
    """Where each of the probe's queries sits among `rows` (flat, ascending indices into [B*T])."""
    flat = probe.batch * t + probe.query
    at = torch.searchsorted(rows, flat).clamp_(max=len(rows) - 1)
    if not torch.equal(rows[at], flat):
        raise ValueError("every probed query must be one of the rows computed")
    return at


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: torch.Tensor, pos: torch.Tensor,
                   probe: AttentionProbe | None = None, probed: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for some queries only: q [N, H, hd] at (batch, pos), ascending; k, v [B, KVH, T, hd]
    -> [N, H, hd]. With `probe` and `probed` (where its queries sit among the N: probe_rows), fills in
    `probe.loss` (as probe_loss) from the same scores.

    The queries are padded per sequence to [B, H, Nmax, hd] for one batched product; a pad slot sees key 0 only."""
    b, heads, t = k.shape[0], q.shape[1], k.shape[2]
    if heads != k.shape[1]:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    counts = torch.bincount(batch, minlength=b)
    local = torch.arange(len(batch), device=q.device) - (counts.cumsum(0) - counts)[batch]  # slot in its sequence
    n = int(counts.max())
    padded = q.new_zeros(b, n, heads, q.shape[-1])
    padded[batch, local] = q
    at = torch.zeros(b, n, dtype=torch.long, device=q.device)
    at[batch, local] = pos
    scores = (padded.transpose(1, 2) @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, H, Nmax, T]
    future = torch.arange(t, device=q.device)[None, None, :] > at[:, :, None]  # [B, Nmax, T]
    logp = scores.masked_fill(future[:, None], float("-inf")).log_softmax(-1)
    if probe is not None:
        slot = local[probed]
        probe.loss = probe_nll(probe, lambda head: logp[probe.batch, head, slot, probe.target])
    o = logp.exp().to(v.dtype) @ v  # [B, H, Nmax, hd]
    return o.transpose(1, 2)[batch, local]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                probe: AttentionProbe | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # one matmul for q, k and v: [B, T, (H + 2 KVH) * hd]
        qkv = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)))
        qkv = qkv.view(b, t, self.heads + 2 * self.kv_heads, self.head_dim)
        qk = apply_rope(qkv[:, :, :self.heads + self.kv_heads], cos, sin_signed)  # [B, T, H + KVH, hd]
        q = qk[:, :, :self.heads].transpose(1, 2)  # [B, H, T, hd]
        k = qk[:, :, self.heads:].transpose(1, 2)  # [B, KVH, T, hd]
        v = qkv[:, :, self.heads + self.kv_heads:].transpose(1, 2)
        if probe is not None:
            probe.loss = probe_loss(q, k, probe)
        o = causal_attention(q, k, v)  # [B, H, T, hd]
        if probe is not None:  # what the probed heads alone write at the probed queries (their slices of o_proj)
            hd = self.head_dim
            probe.output = sum(o[probe.batch, h, probe.query] @ self.o_proj.weight[:, h * hd:(h + 1) * hd].T
                               for h in probe.heads)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rows: torch.Tensor,
                     probe: AttentionProbe | None = None) -> torch.Tensor:
        """The attention output at `rows` only (flat, ascending indices into [B*T]) -> [N, hidden]: keys and
        values at every position, queries only where asked."""
        b, t, _ = x.shape
        kv = F.linear(x, torch.cat((self.k_proj.weight, self.v_proj.weight))).view(b, t, 2 * self.kv_heads, -1)
        k = apply_rope(kv[:, :, :self.kv_heads], cos, sin_signed).transpose(1, 2)  # [B, KVH, T, hd]
        v = kv[:, :, self.kv_heads:].transpose(1, 2)
        pos = rows % t
        q = F.linear(x.flatten(0, 1)[rows], self.q_proj.weight).view(len(rows), self.heads, self.head_dim)
        at = probe_rows(probe, rows, t) if probe is not None else None
        o = rows_attention(apply_rope(q, cos[pos], sin_signed[pos]), k, v, rows // t, pos, probe, at)  # [N, H, hd]
        if probe is not None:
            hd = self.head_dim
            probe.output = sum(o[at, h] @ self.o_proj.weight[:, h * hd:(h + 1) * hd].T for h in probe.heads)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                probe: AttentionProbe | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; with `rows` (flat, ascending indices into [B*T]) the output there
        only, [N, hidden] (keys and values still come from every position)."""
        if rows is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin_signed, probe)
        else:
            x = x.flatten(0, 1)[rows] + self.self_attn.forward_rows(self.input_layernorm(x), cos, sin_signed, rows,
                                                                    probe)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """HF's `model.` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TrainLlama(nn.Module):
    """LlamaForCausalLM for training: `forward(ids)` -> final hidden states; `logits(hidden)` only where needed."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm or cfg.rope_scaling or cfg.sliding_window:
            raise ValueError("TrainLlama is a plain Llama: no biases, q/k norms, rope scaling or sliding window")
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def slow_planes(self, span: int = SLOW_SPAN) -> torch.Tensor:
        """RoPE's planes that turn less than one radian over `span` positions (ascending): a built head that
        matches in them matches by content at any distance within the span."""
        return torch.arange(self.cfg.head_dim // 2)[self.inv_freq * span < 1.0]

    def rope(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions 0..t-1: [T, 1, hd], float32 (as HF computes them before the cast)."""
        freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin()
        return emb.cos()[:, None], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]

    def forward(self, input_ids: torch.Tensor, probe: AttentionProbe | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> hidden states [B, T, hidden] after the final norm (and `probe.loss`, if given).

        With `rows` (flat, ascending indices into [B*T]): the hidden states there only, [N, hidden]. The last
        layer then runs its queries, attention and MLP at those positions alone (every position still gives it
        keys and values): the loss reads only the answers (a fifth of the positions), so this saves most of the
        last layer's work for the same loss and gradients."""
        cos, sin_signed = self.rope(input_ids.shape[1])
        device = input_ids.device.type
        # RoPE in the matmuls' dtype, as HF applies it in bf16
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.model.norm.weight.dtype
        cos, sin_signed = cos.to(dtype), sin_signed.to(dtype)
        x = self.model.embed_tokens(input_ids)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin_signed, probe if probe is not None and probe.layer == i else None,
                      rows=rows if i == last else None)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors as an HF checkpoint names them (no lm_head.weight when tied)."""
        return {k: v for k, v in self.state_dict().items() if not (k == "lm_head.weight" and self.lm_head is None)}
