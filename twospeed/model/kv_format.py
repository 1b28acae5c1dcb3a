"""How K and V sit in the paged cache: the model's dtype, bf16, int8 with a scale per token and KV head, or fp8 e4m3.

Every decode step reads the whole cache, and the pool's size in tokens is its memory over the bytes of one
token, so one byte an element instead of two holds about twice the tokens in the same memory and halves the
bytes each step reads from it (byte counts: schema/formats.py).

A cache tensor is [num_blocks, block_size, num_kv_heads, row]: one row per (token, KV head). For int8 a row is
head_dim values then the row's bf16 scale in its last two bytes (row = head_dim + 2), so the cache stays one
tensor per layer and K or V of a token sits in one place for every reader (the C kernels read it in place):

  int8  scale = bf16(max_d |x[d]| / 127),  q[d] = clamp(round(x[d] / scale), -127, 127)    per (token, KV head)
  fp8   e4m3(clamp(x, -448, 448))                                                          unscaled, as vLLM's default
  bf16  bf16(x), rounded to nearest even                                  a float32 model's; a bf16 model's "auto"

bf16 is for a model computed in float32, chiefly a bf16 checkpoint on a CPU without bf16 instructions
(model/compute_dtype.py): its K and V come from bf16 weights, and a bf16 engine (vLLM's, llama.cpp's, twospeed's
own where the CPU has bf16 kernels) stores them in bf16, so the cache takes half the bytes of float32 and each
decode step reads half. For a bf16 model it is the plain format.

Attention always reads K and V back from the cache, even for the chunk that just wrote them, so every path (the
portable one here, the C kernels) sees the same quantized values. `code` tells the C kernels which format.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from twospeed.schema.formats import kv_format


ALIGN = 64  # bytes: a cache line, an AVX-512 vector


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On a CPU its memory comes from calloc, whose large blocks are fresh pages the OS maps as
    zeros on first touch: the pool costs nothing until blocks are used (torch.zeros writes every byte: ~1.3 s for
    the default 2 GiB, at every engine start). Elsewhere, torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes + ALIGN, dtype=np.uint8))
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)


class KVFormat:
    """Unquantized: K and V in the model's dtype."""

    name = "auto"
    code = 0  # the C kernels' KV_PLAIN / KV_INT8 / KV_FP8
    quantized = False

    def row_width(self, head_dim: int) -> int:
        return head_dim

    def storage(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def allocate(self, shape: tuple[int, ...], head_dim: int, model_dtype: torch.dtype,
                 device: torch.device | str) -> torch.Tensor:
        """Zeroed, not empty: padded decode slots are read (then masked), and 0 * NaN garbage would poison a sum."""
        return zeros((*shape, self.row_width(head_dim)), self.storage(model_dtype), device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., head_dim] in the model's dtype -> cache rows [..., row]."""
        return x

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cache rows [..., row] -> values [..., head_dim] in `dtype`."""
        return rows

    def write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, KVH, head_dim] into the cache slots [T]."""
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, self.encode(x))

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole blocks [n, block_size, KVH, row] (index_select copies rows: 3-10x faster than cache[ids])."""
        return cache.index_select(0, block_ids)


class Int8KV(KVFormat):
    name = "int8"
    code = 1
    quantized = True

    def row_width(self, head_dim: int) -> int:
        return head_dim + 2  # the bf16 scale rides in the row's last two bytes

    def storage(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.float().abs().amax(dim=-1, keepdim=True)
        scale = (amax / 127).to(torch.bfloat16)
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(amax))
        q = torch.round(x.float() / safe).clamp_(-127, 127).to(torch.int8)
        return torch.cat([q, scale.view(torch.int8)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = rows.shape[-1] - 2
        scale = rows[..., d:].contiguous().view(torch.bfloat16).float()
        return (rows[..., :d].float() * scale).to(dtype)


class Fp8KV(KVFormat):
    name = "fp8"
    code = 2
    quantized = True
    FP8_MAX = 448.0

    def storage(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().clamp(-self.FP8_MAX, self.FP8_MAX).to(torch.float8_e4m3fn)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)

    # torch has no index_copy_ / index_select kernels for float8 on CPU: move the same bytes as uint8
    def write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, self.encode(x).view(torch.uint8))

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        return cache.view(torch.uint8).index_select(0, block_ids).view(cache.dtype)


class Bf16KV(KVFormat):
    """bf16 rows under a float32 model: rounded like a quantized format, so every path reads them back."""

    name = "bf16"
    code = 3
    quantized = True

    def storage(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)


KV_FORMATS = {f.name: f for f in (KVFormat, Int8KV, Fp8KV, Bf16KV)}


def make_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype | None = None) -> KVFormat:
    """The format for `kv_cache_dtype`; "bf16" under a bf16 model is the plain one (model_dtype None: taken as not
    bf16)."""
    kv_format(kv_cache_dtype)  # a known name (the torch-free table)
    if kv_cache_dtype == "bf16" and model_dtype == torch.bfloat16:
        return KVFormat()
    return KV_FORMATS[kv_cache_dtype]()
