"""Batch-invariant inference: a row's numbers do not depend on what else is in the step.

By default a step picks its kernels by its row count (a C kernel for a few rows; oneDNN, a BLAS or AMX tiles
past a threshold; a prefill attention for a chunk, a decode attention for one token), and each kernel sums in
its own order. In bf16 that is enough to flip a near-tie between two tokens: a greedy answer can change with
the batch around it, or when speculation verifies a token inside a multi-row chunk instead of decoding it
alone. The deterministic mode (EngineConfig.deterministic) fixes each row's order of operations:

- every linear runs on tiles of exactly `rows` rows (`FixedRowsLinear`; the last tile padded with zeros), so
  every call has one shape, hence one kernel, one blocking and one thread split;
- every query row attends as a decode over its own prefix in the cache: the runner sends prompt chunks and
  verify chunks through the decode path (model/attention.py: `rows_as_decodes`), whose kernels are per row
  (the C kernels' tasks are (row, KV head) pairs; the portable path attends row by row at the row's own width);
- RoPE and the cache write take one path whatever the row count;
- the thread count stays fixed (engine/threads.py's governor is off).

RMSNorm, SwiGLU, the residual adds and the sampler work row by row already. The cost is padding (a decode
step of one row runs `rows` rows through every linear) and prefill at decode-kernel speed: BENCHMARKS.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twospeed.model.weight_format import FormatLinear

DEFAULT_ROWS = 8  # rows per linear call: small enough that a lone decode pays little for its padding


class FixedRowsLinear(nn.Module):
    """A linear of any format, called only on tiles of exactly `rows` rows."""

    def __init__(self, inner: FormatLinear, rows: int):
        super().__init__()
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.inner, self.rows = inner, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        m, r = x2.shape[0], self.rows
        if pad := -m % r:
            x2 = F.pad(x2, (0, 0, 0, pad))  # zero rows: their outputs are dropped
        else:
            x2 = x2.contiguous()
        tiles = [self.inner.forward(tile) for tile in x2.split(r)]
        y = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
        return y[:m].view(*lead, y.shape[-1])


def make_batch_invariant(model: nn.Module, rows: int = DEFAULT_ROWS) -> None:
    """Swap every linear of a loaded model for its fixed-row form; mark the model (its runner then sends every
    query row through the decode path) and its attention backends (one path per row)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FormatLinear):
                setattr(parent, name, FixedRowsLinear(child, rows))
    for layer in model.layers:
        layer.self_attn.attn.batch_invariant = True
    model.batch_invariant = True
