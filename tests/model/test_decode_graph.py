"""The decode graph (model/decode_graph.py, csrc/decode_graph.c) against the Python path it replaces: the same
kernels in the same order, so every decode step's logprobs are equal bit for bit, over several decode groups
(padding splits short and long contexts), a sliding window and q/k/v biases; and the graph stays off where a
piece has no float32 C kernel."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import needs_kernel, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.model.decode_graph import DecodeGraph, graph_kernel
from twospeed.model.packed_linear import widen_kernel

pytestmark = [needs_kernel(graph_kernel, "decode_graph"), needs_kernel(widen_kernel, "linear_widen")]

# whole blocks of 32 along every input, so the GGUF block formats apply too
WIDE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def engine(path, **kw) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_gb=0.02, cost_probe=False, **kw)


def decode(llm: LLM, monkeypatch) -> tuple[list, int]:
    """Greedy tokens with their logprobs for prompts of 3 to 300 tokens, and how many steps took the graph."""
    ran = []
    real = DecodeGraph.run
    monkeypatch.setattr(DecodeGraph, "run", lambda self, *a: ran.append(1) or real(self, *a))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 41, 300, 7)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    out = [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in llm.generate(prompts, params)]
    return out, len(ran)


def python_path(llm: LLM) -> LLM:
    llm.engine.model.decode_graph = None
    return llm


@pytest.mark.parametrize("arch,opts,overrides", [
    ("llama", {}, {}),  # head_dim 12, llama3 rope scaling, widened bf16
    ("mistral", {}, dict(sliding_window=64)),  # a window shorter than the longest context
    ("qwen2", {}, {}),  # q/k/v biases
    ("llama", dict(quantization="int8"), {}),
    ("llama", dict(quantization="q4_0"), WIDE),
    ("llama", dict(quantization="q4_1"), WIDE),
    ("mistral", dict(quantization="q8_0"), WIDE),
    ("llama", dict(kv_cache_dtype="bf16"), {}),  # a bf16 cache: written rounded, read widened
    ("mistral", dict(quantization="q4_0", kv_cache_dtype="bf16"), dict(sliding_window=64, **WIDE)),
])
def test_the_graph_decodes_as_the_python_path_bit_for_bit(tmp_path, monkeypatch, arch, opts, overrides):
    write_hf_checkpoint(tmp_path, arch, torch.bfloat16, **overrides)
    llm = engine(tmp_path, **opts)
    assert llm.engine.model.decode_graph is not None
    graph, steps = decode(llm, monkeypatch)
    assert steps >= 23  # every decode step after the prefills took the graph
    assert graph == decode(python_path(engine(tmp_path, **opts)), monkeypatch)[0]


def test_the_graph_is_seen_to_differ_when_a_kernel_differs(tmp_path, monkeypatch):
    """The comparison above can fail: a graph whose last layer skips its MLP decodes other logprobs."""
    write_hf_checkpoint(tmp_path, "llama", torch.bfloat16)
    llm = engine(tmp_path)
    llm.engine.model.decode_graph._layers[-1].down.n = 0  # no down projection: x keeps the o projection's output
    assert decode(llm, monkeypatch)[0] != decode(python_path(engine(tmp_path)), monkeypatch)[0]


@pytest.mark.parametrize("arch,kw", [
    ("qwen3", {}),  # q/k norms: not in the graph
    ("llama", dict(linear_backend="torch")),  # a linear without a C kernel
    ("llama", dict(attention_backend="torch")),
    ("llama", dict(kv_cache_dtype="int8")),  # a quantized cache
])
def test_the_graph_stays_off_where_a_piece_has_no_float32_kernel(tmp_path, arch, kw):
    write_hf_checkpoint(tmp_path, arch, torch.bfloat16)
    assert engine(tmp_path, **kw).engine.model.decode_graph is None
