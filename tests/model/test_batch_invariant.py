"""The deterministic mode (model/batch_invariant.py) against its promise, in bf16: a greedy request's tokens and
logprobs are bit-identical alone and beside any batch, whatever the chunk budget cut its prompt into, and with
speculation verifying its tokens; a fixed-row linear's row equals that row computed alone.

The reference is the same request run alone in the same engine: the property is equality to the last bit (the
logprobs compared as floats with ==), which any kernel change that lets a neighbour's rows into a row's sums breaks.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.model.batch_invariant import FixedRowsLinear
from twospeed.model.weight_format import make_weight_format

VOCAB = 512


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16-llama")
    write_hf_checkpoint(path, "llama", dtype=torch.bfloat16, vocab_size=VOCAB)
    return path


def engine(path, **kw) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16", deterministic=True, num_gpu_blocks=256,
               block_size=8, max_model_len=512, cost_probe=False, **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=3)


def fingerprint(out) -> list:
    """The tokens and every logprob the request returned, as exact floats."""
    return [out.token_ids, [(s.token_id, s.logprob, s.rank, sorted(s.top.items())) for s in out.logprobs]]


def target_prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    span = [rng.randrange(3, VOCAB) for _ in range(7)]
    return [rng.randrange(3, VOCAB) for _ in range(40)] + span + [rng.randrange(3, VOCAB) for _ in range(9)] + span


def test_a_greedy_request_is_the_same_beside_any_batch_and_any_chunking(bf16_checkpoint):
    alone = fingerprint(engine(bf16_checkpoint).generate([target_prompt()], greedy(24))[0])
    rng = random.Random(1)
    for budget in (512, 37, 8):  # the prompt in one chunk, in chunks of varying sizes, and 8 tokens a step
        llm = engine(bf16_checkpoint, max_num_batched_tokens=budget)
        for _ in range(2):
            others = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 90))] for _ in range(rng.randint(1, 6))]
            prompts = others[:len(others) // 2] + [target_prompt()] + others[len(others) // 2:]
            params = [SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True)
                      for _ in prompts]
            params[len(others) // 2] = greedy(24)
            outs = llm.generate(prompts, params)
            assert fingerprint(outs[len(others) // 2]) == alone, f"budget {budget}"


@pytest.mark.parametrize("budget", [512, 11])
def test_speculation_verifies_to_the_same_tokens_in_bf16(bf16_checkpoint, budget):
    prompts = [target_prompt(s) for s in range(3)]
    plain = engine(bf16_checkpoint, max_num_batched_tokens=budget).generate(prompts, greedy(24))
    # The target as its own draft: its proposals mostly agree, so most tokens come out of verify chunks.
    spec = engine(bf16_checkpoint, max_num_batched_tokens=budget, spec_method="draft",
                  draft_model=str(bf16_checkpoint), num_speculative_tokens=3, spec_auto_fallback=False)
    outs = spec.generate(prompts, greedy(24))
    assert sum(o.spec.accepted for o in outs) > 24  # verify chunks ran and kept drafts
    assert [fingerprint(o) for o in outs] == [fingerprint(o) for o in plain]


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), tile=st.sampled_from([1, 3, 8, 16]), pick=st.integers(0, 39),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), quantization=st.sampled_from([None, "int8"]))
def test_a_fixed_row_linear_row_equals_that_row_alone(rows, tile, pick, dtype, quantization):
    torch.manual_seed(rows)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        lin = make_weight_format(quantization, "auto", "cpu", dtype).linear(96, 80, bias=True)
        lin.load_weight(lin.weight, torch.randn(80, 96))
        lin.load_bias(lin.bias, torch.randn(80))
        lin.finish_loading()
    finally:
        torch.set_default_dtype(default)
    fixed = FixedRowsLinear(lin, tile)
    x = torch.randn(rows, 96).to(dtype)
    i = pick % rows
    batch = fixed.forward(x)
    assert batch.shape == (rows, 80)
    assert torch.equal(batch[i], fixed.forward(x[i:i + 1].clone())[0])
    assert torch.allclose(batch.float(), lin.forward(x).float(), rtol=2e-2, atol=2e-2)  # the same linear


def test_the_flag_reaches_the_engine_config():
    """`serve --deterministic` (a bare boolean flag means true; `--flag false` still turns one off)."""
    import argparse

    from twospeed.config import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--deterministic"]))["deterministic"] is True
    assert engine_kwargs(parser.parse_args(["--deterministic", "false", "--cost-probe", "no"])) == {
        "deterministic": False, "cost_probe": False}
    assert "deterministic" not in engine_kwargs(parser.parse_args([]))
