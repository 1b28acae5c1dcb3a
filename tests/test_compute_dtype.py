"""`dtype: auto` computes in the checkpoint's dtype where the device has kernels for it, else in float32
(model/compute_dtype.py); an explicit dtype is always obeyed."""

from __future__ import annotations

import pytest
import torch

from twospeed.config import EngineConfig
from twospeed.engine.engine import LLMEngine
from twospeed.model import compute_dtype


@pytest.mark.parametrize("fast", [True, False])
def test_a_cpu_without_kernels_for_the_checkpoint_dtype_computes_in_float32(monkeypatch, fast):
    monkeypatch.setattr(compute_dtype, "cpu_computes", lambda dtype: fast or dtype == torch.float32)
    for stored in (torch.bfloat16, torch.float16):
        assert compute_dtype.auto_dtype(stored, "cpu") == (stored if fast else torch.float32)
    assert compute_dtype.auto_dtype(torch.float32, "cpu") == torch.float32
    # a GPU keeps the checkpoint's dtype whatever the host CPU lacks
    assert compute_dtype.auto_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_float32_is_always_fast_on_a_cpu():
    assert compute_dtype.cpu_computes(torch.float32)
    assert not compute_dtype.cpu_computes(torch.int8)


def test_the_engine_resolves_auto_and_obeys_an_explicit_dtype():
    """The bf16 demo: auto follows this CPU (bf16 on AVX-512 BF16 / AMX, float32 on AVX2), bfloat16 stays bf16,
    and the weights and the KV cache are in the dtype the engine reports."""
    auto = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=8, max_model_len=64, cost_probe=False))
    assert auto.dtype == compute_dtype.auto_dtype(torch.bfloat16, "cpu")
    explicit = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=8, max_model_len=64, cost_probe=False,
                                                  dtype="bfloat16"))
    assert explicit.dtype == torch.bfloat16
    for engine in (auto, explicit):
        assert engine.model.embed_tokens.weight.dtype == engine.dtype
        assert engine.runner.kv_cache.dtype == engine.dtype
