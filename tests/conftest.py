"""Shared fixtures: small random checkpoints written by transformers, one per supported architecture."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Hypothesis profiles. `ci` (the default) is derandomized: every run of a commit draws the same examples, so the
# suite's colour never depends on a seed, and no example database carries state between runs. `fuzz` is the
# wide randomized search: `make fuzz` (or `pytest -m hypothesis --hypothesis-profile=fuzz --hypothesis-seed=N`)
# runs the hypothesis tests once per seed; a failure prints its seed and a @reproduce_failure blob. Each test
# keeps its own max_examples; neither profile sets a deadline, and slow data generation is not a failure,
# so a slower or busier machine cannot turn a test red.
_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", derandomize=True, database=None, **_COMMON)
settings.register_profile("fuzz", derandomize=False, **_COMMON)
settings.load_profile("ci")  # `--hypothesis-profile` on the command line loads after this and wins
torch.set_num_threads(1)  # tiny models: threads only add sync cost (and spin when cores are shared)

# Odd shapes on purpose: head_dim not a power of two, kv heads != heads, hidden != heads * head_dim.
ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, vocab_size=301, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=10, vocab_size=257, max_position_embeddings=512, sliding_window=None, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=36, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        vocab_size=263, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=14, vocab_size=289, max_position_embeddings=512, tie_word_embeddings=False)),
}


def needs_kernel(loader, name: str) -> pytest.MarkDecorator:
    """Skip where csrc/<name>.c is unsupported here, with cbuild's reason (no compiler, no instructions). A kernel
    that should build and does not raises KernelBuildError from `loader()` instead: collection fails, loudly."""
    from twospeed.model.cbuild import unsupported_reason

    return pytest.mark.skipif(loader() is None, reason=f"kernel {name} unsupported here: {unsupported_reason(name)}")


def write_hf_checkpoint(path, arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """Save a random-weight transformers model of `arch` into `path` (HF layout) and return the model."""
    import transformers

    config_cls, model_cls, kwargs = ARCH_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    # Random init gives near-uniform logits; a larger spread makes greedy ties impossible in practice.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05 if "embed" in name or "lm_head" in name else 0.2)
    model.save_pretrained(path)
    return model


def float32_llm(path, **kw):
    """The engine over a checkpoint write_hf_checkpoint wrote (token ids only), in float32 as the transformers model
    it is checked against: `dtype: auto` computes a float32 checkpoint in bf16 where the CPU has bf16 kernels
    (model/compute_dtype.py), and exact agreement, with HF or between two of the engine's paths, needs float32."""
    from twospeed import LLM

    return LLM(str(path), **{"skip_tokenizer_init": True, "dtype": "float32", **kw})


@pytest.fixture(scope="session", params=sorted(ARCH_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    """(arch, folder, transformers model) for each architecture, fp32."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_hf_checkpoint(path, request.param)
    return request.param, path, model


@pytest.fixture(scope="session")
def task_model_path():
    """The built-in task model's folder (`demo-task`): trained on first use into the cache folder, so once per
    TWOSPEED_CACHE (CI sets a fresh one: once per run), then loaded from there by every test that needs it."""
    from twospeed.builtin.task_model import task_checkpoint_path

    return task_checkpoint_path("demo-task")


def pytest_configure(config):
    config.addinivalue_line("markers", "task_model: needs the trained demo-task model (a few minutes to build on "
                                       "first use); not in the default run: `make test-task`")
    config.addinivalue_line("markers", "e2e: drives a whole server over HTTP (a `twospeed serve` process or the app in "
                                       "process); in the default run, `-m 'not e2e'` for the fast ones only")
    config.addinivalue_line("markers", "real_model: needs the built-in smollm2 (a ~100 MB download on first use); "
                                       "not in the default run: `make test-real`")


def pytest_collection_modifyitems(config, items):
    """Every test that takes the task model (the fixture) is a task_model test, marked or not."""
    for item in items:
        if "task_model_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.task_model)
