"""Pack a step's chunks into one flat batch, run the model, return the logits that sample.

The runner owns the KV cache tensors: [num_layers, 2, num_blocks, block_size,
num_kv_heads, row] in the cache's format (row = head_dim; int8 adds its scale: model/kv_format.py). The batch puts single-token chunks first (the batched
decode path of the attention) and multi-token chunks after (per-request
prefill spans), so one forward pass serves any mix of prefill and decode.
Only the rows that sample go through the vocabulary matmul: a chunk's last
row, and for a verify chunk (a decode with draft tokens) a row per draft
position too, each the next-token logits after the tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twospeed.config import CacheConfig, ModelConfig
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.engine.request import Request
from twospeed.engine.scheduler import ScheduledChunk
from twospeed.schema import formats
from twospeed.model.attention import AttentionMetadata, DecodeGroup, PrefillBatch, PrefillSpan
from twospeed.model.llama import LlamaForCausalLM

GiB = 1 << 30
# Multi-token chunks this short run through the decode path of the attention: per layer, a 2-token chunk on a
# 2300-token context costs 0.32 ms either way, 1 token 0.15 ms as a decode against 0.35 ms through the prefill
# kernel (whose 16-row tasks are mostly empty lanes for so few rows), 8 tokens 0.87 ms against 0.51 ms
# (BENCHMARKS.md, measured before the kernel stopped transposing the whole context's V each call).
SHORT_CHUNK = 2


@dataclass(slots=True)
class PromptLogits:
    """Logits at prompt positions of a request that asked for prompt logprobs: row i predicts prompt token
    first + i (its position first + i - 1 computed this step)."""

    request: Request
    first: int
    logits: torch.Tensor  # [n, vocab] float32


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token, every layer, in the cache's format (scales included; schema/formats.py)."""
    return formats.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype, dtype.itemsize)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    return block_size * kv_bytes_per_token(cfg, dtype, kv_cache_dtype)


def num_blocks_for(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Pool size: num_gpu_blocks if given, else as many blocks as kv_cache_memory_gb holds in the cache's format."""
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    block = kv_bytes_per_block(cfg, cache.block_size, dtype, cache.kv_cache_dtype)
    return max(1, int(cache.kv_cache_memory_gb * GiB) // block)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        cfg = model.cfg
        self.model, self.block_size, self.device = model, block_size, device
        self.sliding_window = cfg.sliding_window
        # In the format the model's attention reads (model/kv_format.py), zeroed: padded decode slots are read
        self.kv_cache = model.kv_format.allocate((cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads),
                                                 cfg.head_dim, dtype, device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], kv: KVCacheManager
                ) -> tuple[torch.Tensor, list[ScheduledChunk], list[PromptLogits]]:
        """Run one step. Returns logits [S, vocab] float32 and the sampling chunks they belong to, in that order:
        each chunk's num_logits rows (1, or 1 + num_draft for a verify chunk) one after another; and the prompt
        rows' logits of the requests that asked for prompt logprobs."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.start)
        ordered = decodes + [c for c in chunks if c.num_tokens > 1]
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []  # (request, first prompt token predicted, rows)
        for c in ordered:
            table = kv.block_ids(c.request.request_id)
            tables.append(table)
            end = c.start + c.num_tokens
            ids += c.request.all_token_ids[c.start:end - c.num_draft]
            if c.num_draft:  # draft tokens sit after the known ones, in slots reserved for them
                ids += c.request.spec_token_ids[:c.num_draft]
            positions += range(c.start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(c.start, end)]
            if c.samples:
                sample_rows += range(len(ids) - c.num_logits, len(ids))
            if (want := c.request.prompt_logprobs) is not None:
                # position p predicts prompt token p + 1; the last prompt position samples the first output token.
                # From the first token not yet scored: a recomputed prompt (preemption) scores nothing twice.
                lo, hi = max(c.start, len(want) - 1), min(end, c.request.num_prompt_tokens - 1)
                if hi > lo:
                    base = len(ids) - c.num_tokens - c.start  # row of position p: base + p
                    prompt_rows += range(base + lo, base + hi)
                    prompt_spans.append((c.request, lo + 1, hi - lo))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                                 num_decode_tokens=sum(1 for c in ordered if c.num_tokens == 1),
                                 sliding_window=self.sliding_window)
        d = meta.num_decode_tokens
        context_lens = [c.start + 1 for c in ordered[:d]]
        for lo, hi in decode_groups(context_lens):
            meta.decodes.append(self._decode_group(lo, tables[lo:hi], context_lens[lo:hi]))
        offset = d
        spans: list[tuple[int, ScheduledChunk, list[int]]] = []  # (first row, chunk, its block table)
        for c, table in zip(ordered[d:], tables[d:]):
            ctx = c.start + c.num_tokens
            table = table[: -(-ctx // bs)]
            if c.num_tokens <= SHORT_CHUNK or self.model.batch_invariant:
                # A token or two on a context (a grammar-forced token, a one-token prompt or last chunk): attend
                # as that many decodes, query i at position start + i over its own prefix. A prefill pass would
                # sweep the whole context's V for them, every layer. Batch-invariant: every chunk, so a row's
                # attention is the same whether it is decoded, verified or prefilled (model/batch_invariant.py).
                meta.decodes.append(self._decode_group(offset, [table] * c.num_tokens,
                                                       list(range(c.start + 1, ctx + 1))))
            else:
                spans.append((offset, c, table))
            offset += c.num_tokens
        if spans:
            # One padded table for the kernels that take every span in one call; each span's own is a row of it.
            # Masks are left to the portable path, which builds them on first use (the C kernels need none).
            block_tables = _padded([t for _, _, t in spans], dev)
            meta.prefills = [PrefillSpan(start=o, num_tokens=c.num_tokens, context_len=c.start + c.num_tokens,
                                         block_table=block_tables[i, :len(t)]) for i, (o, c, t) in enumerate(spans)]
            meta.prefill_batch = PrefillBatch(
                block_tables=block_tables,
                q_start=torch.tensor([p.start for p in meta.prefills], dtype=torch.int64, device=dev),
                q_len=torch.tensor([p.num_tokens for p in meta.prefills], dtype=torch.int64, device=dev),
                context_len=torch.tensor([p.context_len for p in meta.prefills], dtype=torch.int64, device=dev))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_caches, meta)
        rows = torch.tensor(sample_rows + prompt_rows, dtype=torch.int64, device=dev)
        logits = self.model.compute_logits(hidden[rows])
        prompt, at = [], len(sample_rows)
        for req, first, n in prompt_spans:
            prompt.append(PromptLogits(req, first, logits[at:at + n]))
            at += n
        return logits[:len(sample_rows)], [c for c in ordered if c.samples], prompt

    def _decode_group(self, start: int, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
        """Single-query rows [start, start + len(lens)): block tables padded to the longest (the portable path
        builds the group's mask from seq_lens when it needs one)."""
        return DecodeGroup(start=start, num_tokens=len(lens), block_tables=_padded(tables, self.device),
                           seq_lens=torch.tensor(lens, dtype=torch.int64, device=self.device))


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[n, longest] int64 block tables, padded with block 0."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)


def decode_groups(context_lens: list[int], max_padding: float = 1.25) -> list[tuple[int, int]]:
    """Split decodes, sorted by context length, into [lo, hi) groups whose padded size (longest x count)
    stays within max_padding x their real size: attention reads padding too, so a 64-token stream must
    not be padded to a 4k-token neighbour, yet similar lengths share one batched call."""
    groups, lo, total = [], 0, 0
    for i, n in enumerate(context_lens):
        if i > lo and n * (i - lo + 1) > max_padding * (total + n):
            groups.append((lo, i))
            lo, total = i, 0
        total += n
    if context_lens:
        groups.append((lo, len(context_lens)))
    return groups
