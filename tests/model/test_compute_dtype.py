"""`dtype: auto` (model/compute_dtype.py): a float32 checkpoint computes in bf16 where the device has fast bf16
kernels; a bf16 or fp16 one in its own dtype where the device has kernels for it, else in float32. An explicit
dtype is always obeyed; the engine says its choice at start and /v1/models shows it."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import torch

from conftest import write_hf_checkpoint
from twospeed.config import EngineConfig
from twospeed.engine.engine import LLMEngine
from twospeed.model import compute_dtype


@pytest.mark.parametrize("fast", [True, False])
def test_auto_computes_float32_in_bf16_and_half_checkpoints_in_float32_as_the_cpu_allows(monkeypatch, fast):
    monkeypatch.setattr(compute_dtype, "cpu_computes", lambda dtype: fast or dtype == torch.float32)
    assert compute_dtype.auto_dtype(torch.float32, "cpu") == (torch.bfloat16 if fast else torch.float32)
    for stored in (torch.bfloat16, torch.float16):
        assert compute_dtype.auto_dtype(stored, "cpu") == (stored if fast else torch.float32)


@pytest.mark.parametrize("bf16", [True, False])
def test_a_gpu_computes_float32_in_half_precision_and_keeps_a_half_checkpoint(monkeypatch, bf16):
    monkeypatch.setattr(compute_dtype, "cpu_computes", lambda dtype: dtype == torch.float32)  # the host CPU's lack
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert compute_dtype.auto_dtype(torch.float32, "cuda:0") == (torch.bfloat16 if bf16 else torch.float16)
    assert compute_dtype.auto_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_a_cpu_device_never_asks_cuda(monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("CUDA asked about a CPU device")

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", no_cuda)
    for stored in (torch.float32, torch.bfloat16, torch.float16):
        compute_dtype.auto_dtype(stored, "cpu")


def test_float32_is_always_fast_on_a_cpu():
    assert compute_dtype.cpu_computes(torch.float32)
    assert not compute_dtype.cpu_computes(torch.int8)


def test_the_engine_resolves_auto_and_obeys_an_explicit_dtype():
    """The bf16 demo: auto follows this CPU (bf16 on AVX-512 BF16 / AMX, float32 on AVX2), bfloat16 stays bf16,
    and the weights are in the dtype the engine reports; the KV cache in the checkpoint's bf16 under auto (float32
    compute keeps a bf16 cache), in the compute dtype under an explicit one."""
    auto = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=8, max_model_len=64, cost_probe=False))
    assert auto.dtype == compute_dtype.auto_dtype(torch.bfloat16, "cpu")
    explicit = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=8, max_model_len=64, cost_probe=False,
                                                  dtype="bfloat16"))
    assert explicit.dtype == torch.bfloat16
    forced = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=8, max_model_len=64, cost_probe=False,
                                                dtype="float32"))
    for engine in (auto, explicit, forced):
        assert engine.model.embed_tokens.weight.dtype == engine.dtype
    assert auto.runner.kv_cache.dtype == torch.bfloat16 and explicit.runner.kv_cache.dtype == torch.bfloat16
    assert auto.memory().kv_cache_dtype == ("bf16" if auto.dtype == torch.float32 else "auto")
    assert forced.runner.kv_cache.dtype == torch.float32 and forced.memory().kv_cache_dtype == "auto"


@pytest.fixture(scope="module")
def float32_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("f32")
    write_hf_checkpoint(path, "llama")  # saved in float32, as transformers saves by default
    return str(path)


def f32_engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(path, skip_tokenizer_init=True, num_gpu_blocks=8, max_model_len=64,
                                              cost_probe=False, **kw))


@pytest.mark.parametrize("fast", [True, False])
def test_the_engine_computes_a_float32_checkpoint_in_bf16_where_fast_and_says_so(monkeypatch, caplog,
                                                                                 float32_checkpoint, fast):
    monkeypatch.setattr(compute_dtype, "cpu_computes", lambda dtype: fast or dtype == torch.float32)
    with caplog.at_level(logging.INFO, logger="twospeed.engine.engine"):
        engine = f32_engine(float32_checkpoint)
    expected = torch.bfloat16 if fast else torch.float32
    assert engine.dtype == engine.model.embed_tokens.weight.dtype == engine.runner.kv_cache.dtype == expected
    memory = engine.memory()
    assert (memory.dtype, memory.checkpoint_dtype) == (str(expected).removeprefix("torch."), "float32")
    said = [r for r in caplog.records if "checkpoint stored in float32" in r.getMessage()]
    assert len(said) == fast and all(r.levelno == logging.WARNING for r in said)
    if fast:
        assert "computing in bfloat16" in said[0].getMessage() and "--dtype float32" in said[0].getMessage()


def test_an_explicit_float32_is_obeyed_where_bf16_is_fast(monkeypatch, caplog, float32_checkpoint):
    monkeypatch.setattr(compute_dtype, "cpu_computes", lambda dtype: True)
    with caplog.at_level(logging.INFO, logger="twospeed.engine.engine"):
        engine = f32_engine(float32_checkpoint, dtype="float32")
    assert engine.dtype == engine.model.embed_tokens.weight.dtype == engine.runner.kv_cache.dtype == torch.float32
    assert (engine.memory().dtype, engine.memory().checkpoint_dtype) == ("float32", "float32")
    assert not [r for r in caplog.records if "computing in" in r.getMessage()]


def test_v1_models_shows_the_compute_and_checkpoint_dtypes(monkeypatch, float32_checkpoint):
    import gc

    from twospeed.server.app import ServerConfig, build_app

    monkeypatch.setattr(compute_dtype, "cpu_computes", lambda dtype: True)
    engine = f32_engine(float32_checkpoint)
    app = build_app(engine.config, ServerConfig(), engine=engine)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
                return (await client.get("/v1/models")).json()

    try:
        models = asyncio.run(main())
    finally:
        gc.unfreeze()  # the server froze this test process's heap at startup
    formats = models["data"][0]["twospeed"]
    assert (formats["dtype"], formats["checkpoint_dtype"]) == ("bfloat16", "float32")
