"""What each weight format and KV cache dtype costs in bytes, without torch (the planner and the lab read these).

A decode step reads every weight and the whole KV cache, so these byte counts set its floor. The format classes
(model/packed_linear.py, model/quant.py) and the KV pool (engine/runner.py) count their own bytes through
these functions, so what the planner predicts is what the engine allocates.

Weight formats (`quantization`):
  None     the checkpoint's dtype (or `dtype`): 2 bytes a weight in bf16, 4 in fp32
  int8     1 byte a weight + a float32 scale per output row (per-output-channel symmetric)
  fp8      1 byte a weight (e4m3) + a float32 scale per output row
  q8_0     GGUF's Q8_0: blocks of 32 weights along the input, 32 int8 + an fp16 scale: 34 / 32 bytes a weight
  q4_0     GGUF's Q4_0: 32 nibbles + an fp16 scale per 32: 18 / 32 bytes a weight
  q4_1     GGUF's Q4_1: 32 nibbles + fp16 scale and min per 32: 20 / 32
  q4_k     GGUF's Q4_K: super-blocks of 256, nibbles + 6-bit scale and min per 32 + fp16 d, dmin: 144 / 256
           (a linear whose input is not a multiple of 256 falls back to q4_0: the same bytes)
  gguf     a GGUF file's own block formats (Q8_0, Q4_0, Q4_1, Q4_K), anything else in q8_0: priced at q8_0's
           bytes, the most any linear holds under it (the model counts what it holds: weight_bytes())
KV cache dtypes (`kv_cache_dtype`):
  auto     the model's dtype (a bf16 checkpoint computed in float32 under dtype auto: bf16, model/compute_dtype.py)
  bf16     2 bytes an element: a float32 model's K and V rounded to bf16 (for a bf16 model, the same as auto)
  int8     1 byte an element + a bf16 scale per token and KV head, for K and for V
  fp8      1 byte an element (e4m3, unscaled: K and V stay well inside e4m3's +-448)
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Bytes of one linear's weight in a format: `per_weight` each, plus `per_row` for each output row (scales)."""

    per_weight: float | None  # None: the activation dtype's size (an unquantized weight)
    per_row: int = 0

    def linear(self, out_features: int, in_features: int, dtype_bytes: int) -> int:
        """Bytes a decode step reads for one [out_features, in_features] weight (bias not included)."""
        per = dtype_bytes if self.per_weight is None else self.per_weight
        return int(out_features * in_features * per) + out_features * self.per_row


# GGUF's block layouts (model/block_kinds.py): type name -> (weights per block, bytes per block)
BLOCK_LAYOUTS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}


def _block(kind: str) -> WeightBytes:
    weights, nbytes = BLOCK_LAYOUTS[kind]
    return WeightBytes(nbytes / weights)  # exact in binary: a whole number of bytes for every whole block


WEIGHT_BYTES = {None: WeightBytes(None), "int8": WeightBytes(1, 4), "fp8": WeightBytes(1, 4),
                "q8_0": _block("Q8_0"), "q4_0": _block("Q4_0"), "q4_1": _block("Q4_1"), "q4_k": _block("Q4_K"),
                "gguf": _block("Q8_0"),
                # test-only formats (model/quant.py): deliberately destructive, for the gate's own tests
                "test-int4-per-tensor": WeightBytes(1, 0), "test-random-scale": WeightBytes(1, 4)}
# what users choose from; the test-only names are accepted but not listed
QUANTIZATIONS = ("int8", "fp8", "q8_0", "q4_0", "q4_1", "q4_k", "gguf")


@dataclass(frozen=True, slots=True)
class KVBytes:
    """Bytes of one cached element: `per_elem` each, plus `per_head` for each (token, KV head) of K and of V."""

    per_elem: int | None  # None: the model's dtype
    per_head: int = 0  # the int8 scale (bf16)


KV_CACHE_DTYPES = {"auto": KVBytes(None), "bf16": KVBytes(2), "int8": KVBytes(1, 2), "fp8": KVBytes(1)}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str = "auto",
                       model_dtype_bytes: int = 2) -> int:
    """K and V of one token, every layer, scales included: what a cached token costs in memory and in each
    decode step that attends to it."""
    kv = kv_format(kv_cache_dtype)
    per = model_dtype_bytes if kv.per_elem is None else kv.per_elem
    return 2 * num_layers * num_kv_heads * (head_dim * per + kv.per_head)


def kv_format(kv_cache_dtype: str) -> KVBytes:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def weight_format(quantization: str | None) -> WeightBytes:
    if quantization not in WEIGHT_BYTES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), got {quantization!r}")
    return WEIGHT_BYTES[quantization]
