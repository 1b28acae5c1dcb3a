"""The dtype the engine computes in when its config says `dtype: auto`.

A checkpoint's dtype says how its weights are stored, not what the device multiplies fast. Two rules follow:

- A float32 checkpoint (transformers saves in float32 by default) computes in half precision where the device
  has fast kernels for it, as vLLM's `auto` does: bfloat16 on a CPU with bf16 kernels (AVX-512 BF16, AMX), on a
  GPU bfloat16 where it supports it, else float16. On such a CPU float32 misses the bf16 kernels (the C linears,
  AMX): measured 2-3x slower than bf16, with a KV cache of twice the bytes. `dtype: float32` keeps float32.
- A bf16 (or fp16) checkpoint computes in its own dtype, except on a CPU without kernels for it (no AVX-512 BF16,
  AMX or AVX-512 emulation in oneDNN), where torch runs a bf16 matmul through a scalar fallback. Measured on a
  2-core AVX2 Zen 3: a [1536 x 256] x [256 x 1024] product took 724 ms in bf16 and 8.4 ms in float32; a 16-row
  decode linear 9.6 ms against 2.0 ms. There it computes in float32: activations and KV cache twice the bytes,
  5-90x the speed. Its weights need not double: the dense format keeps them in bf16 and widens them in registers
  (model/packed_linear.py, `WidenPacking`).

The KV cache follows the checkpoint there too: a bf16 checkpoint computed in float32 because the CPU lacks bf16
kernels keeps its K and V in bf16 (`kv_cache_dtype: auto` -> "bf16", model/kv_format.py), as every bf16 engine
stores them: half the cache's bytes, so twice the tokens in the pool and half the bytes each decode step reads
(the gain where the cache streams from memory: BENCHMARKS.md, CPU kernels). So does a GGUF file of block-quantized
weights (float32 holds them exactly, and is what it computes in here): llama.cpp keeps such a model's cache in f16.
An explicit `dtype` is always obeyed (LLMEngine; this module decides `auto` only); under an explicit float32
the cache is float32 too.
Input: the checkpoint's dtype and the device. Output: the dtype the weights, activations and KV cache use.
"""

from __future__ import annotations

import torch


def cpu_computes(dtype: torch.dtype) -> bool:
    """Whether this CPU has fast kernels for `dtype` (float32 always; bf16/fp16 where oneDNN says so)."""
    if dtype == torch.float32:
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def auto_dtype(checkpoint_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """What `dtype: auto` computes a checkpoint stored in `checkpoint_dtype` in on `device` (the module says why)."""
    kind = torch.device(device).type
    if kind == "cpu":
        if checkpoint_dtype == torch.float32:
            return torch.bfloat16 if cpu_computes(torch.bfloat16) else torch.float32
        return checkpoint_dtype if cpu_computes(checkpoint_dtype) else torch.float32
    if kind == "cuda" and checkpoint_dtype == torch.float32:  # only here is CUDA asked anything
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return checkpoint_dtype


def auto_kv_cache_dtype(checkpoint_dtype: torch.dtype, computed: torch.dtype, dtype_auto: bool,
                        quantized_weights: bool = False) -> str:
    """What `kv_cache_dtype: auto` stores: "bf16" for a bf16 checkpoint, or one of block-quantized weights, that
    `dtype: auto` computes in float32 (the module says why), else "auto" (the compute dtype)."""
    half = checkpoint_dtype == torch.bfloat16 or quantized_weights
    if dtype_auto and half and computed == torch.float32:
        return "bf16"
    return "auto"
