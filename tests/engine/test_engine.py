"""The Python API's contract: clear errors before anything is allocated, aborts return blocks, text matches ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.engine.runner import decode_groups


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_hf_checkpoint(path, "llama")
    return LLM(str(path), skip_tokenizer_init=True, block_size=4, num_gpu_blocks=64, max_model_len=128)


def _idle(llm) -> bool:
    e = llm.engine
    return e.kv.num_free_blocks == e.num_blocks and not e.has_unfinished_requests()


def test_prompt_longer_than_max_model_len_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"200 tokens.*max_model_len is 128"):
        llm.generate([list(range(3, 203))])
    assert _idle(llm)


def test_prompt_that_cannot_fit_the_pool(tmp_path):
    write_hf_checkpoint(tmp_path, "llama")
    small = LLM(str(tmp_path), skip_tokenizer_init=True, block_size=4, num_gpu_blocks=5)
    with pytest.raises(ValueError, match=r"KV pool: 5 blocks of 4 tokens"):
        small.engine.add_request(None, list(range(3, 30)))
    assert small.engine.kv.num_free_blocks == 5


@pytest.mark.parametrize("prompt, message", [([], "empty"), ([5, 999], r"\[0, 301\)"), ([-1], r"\[0, 301\)"),
                                             ("text", "tokenizer")])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(None, prompt)
    assert _idle(llm)


def test_batch_with_one_bad_prompt_admits_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], list(range(3, 300))])
    assert _idle(llm)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-0.1), dict(temperature=float("nan")),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0), dict(top_k=-3),
                                    dict(min_tokens=5, max_tokens=2), dict(stop=[""])])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_unknown_engine_option(tmp_path):
    with pytest.raises(TypeError, match="block_sise"):
        LLM("demo", block_sise=16)


def test_abort_returns_blocks(llm):
    e = llm.engine
    a = e.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = e.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert e.kv.num_free_blocks < e.num_blocks
    assert e.abort_request("a") and e.abort_request("b")
    assert not e.abort_request("a")
    assert a.finish_reason == "abort" and b.clock.finished is not None
    assert _idle(llm)


def test_max_model_len_caps_output(llm):
    out = llm.generate([list(range(3, 120))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 128 - 117 and out.finish_reason == "length"


def test_duplicate_request_id(llm):
    llm.engine.add_request("dup", [5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", [5, 6])
    llm.engine.abort_request("dup")
    assert _idle(llm)


def test_demo_text_matches_token_ids():
    llm = LLM("demo", max_model_len=256)
    outs = llm.generate(["The cache holds the prefix", "Decode is bound by bandwidth"],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids)
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)


@given(st.lists(st.integers(1, 5000), max_size=40))
def test_decode_groups_cover_in_order_and_bound_padding(lengths):
    lengths = sorted(lengths)
    groups = decode_groups(lengths)
    assert [i for lo, hi in groups for i in range(lo, hi)] == list(range(len(lengths)))
    for lo, hi in groups:
        assert hi > lo
        if hi - lo > 1:  # a group of one is never padded
            assert lengths[hi - 1] * (hi - lo) <= 1.25 * sum(lengths[lo:hi])


def test_mixed_context_lengths_decode_like_alone(llm):
    """A 5-token and a 110-token stream decode in separate padded groups; each matches its solo run."""
    prompts = [list(range(3, 8)), list(range(3, 113)), list(range(50, 56))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        assert llm.generate([prompt], params)[0].token_ids == out.token_ids
