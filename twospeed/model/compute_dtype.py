"""The dtype the engine computes in when its config says `dtype: auto`.

A checkpoint's dtype says how its weights are stored, not what the device multiplies fast. On a CPU without
bf16 dot products (no AVX-512 BF16, AMX or AVX-512 emulation in oneDNN), torch runs a bf16 matmul through a
scalar fallback. Measured on a 2-core AVX2 Zen 3: a [1536 x 256] x [256 x 1024] product took 724 ms in bf16 and
8.4 ms in float32; a 16-row decode linear 9.6 ms against 2.0 ms. So there a bf16 (or fp16) checkpoint computes
in float32: activations and KV cache twice the bytes, 5-90x the speed. Its weights need not double: the dense
format keeps a bf16 checkpoint's weights in bf16 and widens them in registers (model/packed_linear.py,
`WidenPacking`). An explicit `dtype` is always obeyed. On a GPU the checkpoint's dtype stands.

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
    """The checkpoint's dtype, unless the device is a CPU without fast kernels for it: then float32."""
    if torch.device(device).type != "cpu" or cpu_computes(checkpoint_dtype):
        return checkpoint_dtype
    return torch.float32
