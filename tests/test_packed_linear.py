"""The CPU fast path (oneDNN-prepacked bf16 linears) against the portable one (F.linear): bit-identical."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ARCH_CONFIGS, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.model.loader import load_model
from twospeed.model.packed_linear import PackedLinear, can_prepack

pytestmark = pytest.mark.skipif(not can_prepack("cpu", torch.bfloat16), reason="no oneDNN bf16 kernels on this CPU")


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("shape,bias", [((40, 72), False), ((72, 40), True), ((768, 2048), False), ((13, 301), True)])
def test_packed_linear_matches_f_linear(rows, shape, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(*shape, bias=bias).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, shape[0], dtype=torch.bfloat16)
    expected = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(PackedLinear(lin)(x), expected)


def test_prepacked_model_replaces_every_linear_and_counts_the_same_bytes(tmp_path):
    write_hf_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    plain = load_model(tmp_path, torch.bfloat16, prepack=False)
    packed = load_model(tmp_path, torch.bfloat16)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 4 * len(packed.layers)
    assert packed.weight_bytes() == plain.weight_bytes()
    assert load_model(tmp_path, torch.float32).logits_packed is None  # fp32 keeps the portable path


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_engine_tokens_and_logprobs_identical_with_and_without_prepacking(tmp_path, arch):
    write_hf_checkpoint(tmp_path, arch, dtype=torch.bfloat16)
    vocab = ARCH_CONFIGS[arch][2]["vocab_size"]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 33, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    runs = []
    for prepack in (False, True):
        llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, prepack_weights=prepack,
                  max_num_batched_tokens=24)  # chunked: steps mix decodes and prefill chunks
        assert (llm.engine.model.logits_packed is not None) == prepack
        runs.append(llm.generate(prompts, params))
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
