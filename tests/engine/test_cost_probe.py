"""The start-up probe: its wide warm-up runs one decoder layer (the same function as a one-layer model), puts the
whole model back, and leaves the KV pool as it found it."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import float32_llm, write_hf_checkpoint
from twospeed import SamplingParams
from twospeed.engine.cost_probe import first_layer_only


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, write_hf_checkpoint(path, "llama", num_hidden_layers=3)


def greedy_logprobs(llm, prompt: list[int]) -> list[float]:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True))[0]
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def hf_logprobs(model, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def test_first_layer_only_is_a_one_layer_model_and_puts_every_layer_back(checkpoint):
    path, hf = checkpoint
    llm = float32_llm(path, block_size=4, num_gpu_blocks=64, max_model_len=128, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.num_blocks and engine.kv.num_cached_blocks == 0  # the probe's blocks
    model = engine.runner.model
    layers = model.layers
    one = copy.deepcopy(hf)
    one.model.layers = one.model.layers[:1]
    one.config.num_hidden_layers = 1
    prompt = [5, 17, 42, 99, 7, 250, 31, 8, 64]
    with first_layer_only(model):
        assert len(model.layers) == 1
        truncated = greedy_logprobs(llm, prompt)
    assert model.layers is layers and len(layers) == 3
    assert truncated == pytest.approx(hf_logprobs(one, prompt), abs=1e-4)
    full = greedy_logprobs(llm, prompt)
    assert full == pytest.approx(hf_logprobs(hf, prompt), abs=1e-4) and full != pytest.approx(truncated, abs=1e-2)
    with pytest.raises(RuntimeError), first_layer_only(model):
        raise RuntimeError("a failed warm-up")
    assert model.layers is layers
