"""Attention over the paged KV cache for one flat batch.

A step's flat batch holds the new tokens of several requests: decode tokens
(query length 1) first, then prefill chunks (query length > 1, possibly
continuing an earlier chunk or a prefix-cache hit). The runner builds one
`AttentionMetadata` per step; every layer reuses it.

The KV cache of one layer is a pair of tensors [num_blocks, block_size,
num_kv_heads, row] (row = head_dim, or head_dim + 2 for int8 with its scale:
model/kv_format.py); a request's tokens live in the blocks its block table
names, so position p is at slot block_table[p // block_size] * block_size +
p % block_size.

`TorchPagedAttention` is the portable backend (any torch device): it gathers a
request's blocks and calls scaled_dot_product_attention. A device-specific
backend (a paged kernel, CUDA graphs) implements the same `forward` and is
tested against this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from twospeed.model.kv_format import KVFormat


@dataclass(slots=True)
class PrefillSpan:
    """One request's prefill chunk inside the flat batch."""

    start: int  # index of its first query token in the flat batch
    num_tokens: int  # query tokens in this chunk
    context_len: int  # tokens it attends to (cached + earlier chunks + this chunk)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64 block ids
    # [num_tokens, context_len] bool, True = attend; None: causal over the positions (and the metadata's sliding
    # window), built by the portable path on first use: the C kernels derive it from the positions themselves
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeGroup:
    """Single-query rows of similar context length, attended in one padded batch: decode tokens, or the few
    tokens of a short chunk (the runner's SHORT_CHUNK), each row over its own prefix."""

    start: int  # index of its first token in the flat batch
    num_tokens: int
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with block 0
    seq_lens: torch.Tensor  # [n] int64: context length of each (its query sits at position len - 1)
    # [n, 1, 1, max_blocks * block_size] bool, True = attend; None: from seq_lens (and the metadata's sliding
    # window), built by the portable path on first use (the C kernels read seq_lens)
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillBatch:
    """Every prefill span of the step in one set of tensors, for a kernel that takes them all in one call."""

    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with block 0
    q_start: torch.Tensor  # [n] int64: first row of each span in the flat batch
    q_len: torch.Tensor  # [n] int64
    context_len: torch.Tensor  # [n] int64


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    num_decode_tokens: int  # the first D tokens of the batch are decodes, sorted by context length
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    prefill_batch: PrefillBatch | None = None  # the same spans as `prefills`, batched; None when there are none
    sliding_window: int | None = None  # tokens a query may look back; None = full (for masks built on demand)


def causal_mask(num_tokens: int, context_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """[num_tokens, context_len] mask for a chunk whose queries are the last num_tokens positions of the context.

    Returns None when the chunk starts at position 0 with no window: SDPA's own is_causal is then exact and faster.
    """
    if context_len == num_tokens and (sliding_window is None or sliding_window >= num_tokens):
        return None
    q_pos = torch.arange(context_len - num_tokens, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def decode_mask(seq_lens: list[int] | torch.Tensor, width: int, sliding_window: int | None,
                device: torch.device) -> torch.Tensor:
    """[D, 1, 1, width] mask: key j is visible to a decode query at position len-1."""
    lens = torch.as_tensor(seq_lens, device=device)[:, None]
    k_pos = torch.arange(width, device=device)[None, :]
    mask = k_pos < lens
    if sliding_window is not None:
        mask &= k_pos > lens - 1 - sliding_window
    return mask[:, None, None, :]


class TorchPagedAttention:
    """Portable paged attention: gather the blocks, then scaled_dot_product_attention."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv: KVFormat | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gqa = num_heads != num_kv_heads
        self.kv = kv or KVFormat()  # how K and V are stored in the cache (model/kv_format.py)
        # Every query row attends by itself, at its own width (model/batch_invariant.py): SDPA's blocking
        # follows the padded width of a group, so a row's sums would otherwise depend on its neighbours.
        self.batch_invariant = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [T, H, hd]; k, v: [T, KVH, hd]; k_cache, v_cache: [N, bs, KVH, hd]
        self.write_cache(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        self.decode(q, k_cache, v_cache, meta, out)
        self.prefill(q, k, v, k_cache, v_cache, meta, out)
        return out

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> None:
        self.kv.write(k_cache, meta.slot_mapping, k)
        self.kv.write(v_cache, meta.slot_mapping, v)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               out: torch.Tensor) -> None:
        for group in meta.decodes:
            if self.batch_invariant:
                bs = k_cache.shape[1]
                for i, n in enumerate(group.seq_lens.tolist()):
                    table = group.block_tables[i:i + 1, :-(-n // bs)]
                    row = DecodeGroup(group.start + i, 1, table, group.seq_lens[i:i + 1])
                    self.decode_group(q, k_cache, v_cache, row, meta.sliding_window, out)
            else:
                self.decode_group(q, k_cache, v_cache, group, meta.sliding_window, out)

    def decode_group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                     sliding_window: int | None, out: torch.Tensor) -> None:
        """One padded SDPA call for the group's single-query rows."""
        g = self.num_heads // self.num_kv_heads
        s, n = group.start, group.num_tokens
        if group.mask is None:  # built once per step, shared by the layers
            width = group.block_tables.shape[1] * k_cache.shape[1]
            group.mask = decode_mask(group.seq_lens, width, sliding_window, q.device)
        # [n * max_blocks, bs, KVH, hd] -> [n, KVH, L, hd]. index_select copies whole blocks (memcpy rows);
        # advanced indexing (k_cache[tables]) took 3-10x longer for the same bytes.
        ids = group.block_tables.reshape(-1)
        kd = self.kv.decode(self.kv.gather(k_cache, ids), q.dtype).view(n, -1, self.num_kv_heads, self.head_dim)
        vd = self.kv.decode(self.kv.gather(v_cache, ids), q.dtype).view(n, -1, self.num_kv_heads, self.head_dim)
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)
        # The G query heads of one KV head become its "query length": [n, KVH, G, hd]. One dense SDPA
        # call, no repeated K/V (head h reads KV head h // G, as HF's repeat_interleave does).
        qd = q[s:s + n].view(n, self.num_kv_heads, g, self.head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask)
        out[s:s + n] = od.reshape(n, self.num_heads, self.head_dim)

    def prefill(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        self.prefill_spans(meta.prefills, q, k, v, k_cache, v_cache, meta, out)

    def prefill_spans(self, spans: list[PrefillSpan], q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Each span by one SDPA call. k, v: this step's fresh K/V, or None when they are only in the cache."""
        for span in spans:
            s, e = span.start, span.start + span.num_tokens
            if span.mask is None:  # once per step (stays None for a plain causal chunk from position 0)
                span.mask = causal_mask(span.num_tokens, span.context_len, meta.sliding_window, q.device)
            if span.context_len == span.num_tokens and not self.kv.quantized and k is not None:
                kp, vp = k[s:e], v[s:e]  # nothing before this chunk: use the fresh K/V directly
            else:  # from the cache (a quantized one always: every path attends to the values it keeps)
                kp = self.kv.decode(self.kv.gather(k_cache, span.block_table).flatten(0, 1)[: span.context_len], q.dtype)
                vp = self.kv.decode(self.kv.gather(v_cache, span.block_table).flatten(0, 1)[: span.context_len], q.dtype)
            # 4-D inputs: SDPA's fused CPU kernel only takes batched tensors (3-D falls back to the slow math path)
            op = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None],
                attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=self.gqa)
            out[s:e] = op[0].transpose(0, 1)
