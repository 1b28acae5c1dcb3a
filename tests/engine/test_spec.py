"""Speculative decoding against references: greedy output token-identical to HF transformers' generate and to
the engine without speculation, with each proposer (prompt lookup; a draft model that always agrees, the target
itself; one that mostly does not, another random checkpoint), in mixed batches, with tiny chunk budgets, a warm
prefix cache, forced preemption; with structured output, stop strings, min_tokens and logprobs on the demo model;
seeded sampling token-identical with and without it. The trace and the bill agree with the tokens (output =
1 + decode steps + kept drafts), blocks all come back, and no block is cached under an unverified token.

Runs in float32 (the reference tests' dtype): a verify chunk computes a position in a multi-token pass where plain
decoding computes it alone, which is exact in fp32 and may flip a random model's near-tie in bf16.
"""

from __future__ import annotations

import random

import pytest

from conftest import float32_llm, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.engine.sampling_params import StructuredOutput
from test_reference import hf_greedy


def repeating_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated spans (prompt lookup finds them) and one without, lengths 3..60."""
    rng = random.Random(seed)
    word = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    a, b, shared = word(6), word(9), word(20)
    return [a + b + a, word(3), shared + a + b + a + b[:2], word(40) + a + word(5) + a, shared + word(7) + shared[:6],
            word(17)]


MAX_TOKENS = [14, 9, 12, 16, 11, 10]


@pytest.fixture(scope="module")
def reference(hf_checkpoint, tmp_path_factory):
    arch, path, model = hf_checkpoint
    prompts = repeating_prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    other = tmp_path_factory.mktemp(f"{arch}-draft")
    write_hf_checkpoint(other, arch, seed=7, num_hidden_layers=1)  # same vocabulary, other weights
    return arch, path, other, prompts, expected


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


PROPOSERS = {"ngram": dict(spec_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3),
             "self-draft": dict(spec_method="draft", draft_model="@self"),
             "other-draft": dict(spec_method="draft", draft_model="@other")}
SETUPS = {  # (proposer, engine options)
    "ngram/budget-64": ("ngram", dict(max_num_batched_tokens=64)),
    "ngram/chunk-3": ("ngram", dict(max_num_batched_tokens=3)),  # smaller than a verify chunk: drafts get cut
    "ngram/chunk-11-bs4": ("ngram", dict(max_num_batched_tokens=11, block_size=4)),
    "ngram/no-fallback-gamma-6": ("ngram", dict(max_num_batched_tokens=32, num_speculative_tokens=6,
                                                spec_auto_fallback=False)),
    "self-draft/chunk-13": ("self-draft", dict(max_num_batched_tokens=13, block_size=4)),
    "other-draft/budget-64": ("other-draft", dict(max_num_batched_tokens=64, spec_auto_fallback=False)),
    "other-draft/one-at-a-time": ("other-draft", dict(max_num_seqs=1, max_num_batched_tokens=32)),
}


def spec_llm(path, other, proposer: str, **kw) -> LLM:
    opts = dict(PROPOSERS[proposer])
    if "draft_model" in opts:
        opts["draft_model"] = str(path if opts["draft_model"] == "@self" else other)
    return float32_llm(path, **{"block_size": 8, "num_gpu_blocks": 256, **opts, **kw})


def check_trace(out, preempted: bool = False) -> None:
    """The trace, the bill and the clock agree with the tokens."""
    t, b = out.spec, out.bill
    assert t.proposed == b.spec_proposed == b.spec_accepted + b.spec_rejected
    assert t.accepted == b.spec_accepted <= t.proposed
    assert sum(t.accepted_per_position) == t.accepted and sum(t.proposed_per_position) == t.proposed
    assert all(a <= p for a, p in zip(t.accepted_per_position, t.proposed_per_position))
    assert t.verify_steps <= out.clock.decode_steps
    if not preempted:  # every step yields its sample plus its kept drafts
        assert len(out.token_ids) == 1 + out.clock.decode_steps + t.accepted + b.forced_tokens


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_greedy_with_speculation_matches_hf(reference, setup):
    arch, path, other, prompts, expected = reference
    proposer, kw = SETUPS[setup]
    llm = spec_llm(path, other, proposer, **kw)
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    for prompt, out, exp in zip(prompts, outs, expected):
        assert out.token_ids == exp, f"{arch}/{setup}: prompt of {len(prompt)} tokens"
        check_trace(out)
    proposed = sum(o.spec.proposed for o in outs)
    accepted = sum(o.spec.accepted for o in outs)
    assert proposed > 0, "nothing was ever proposed: the test checks nothing"
    if proposer == "self-draft":  # the target as its own draft agrees with itself
        assert accepted == proposed
    if proposer == "other-draft" and not kw.get("max_num_seqs"):
        assert accepted < proposed  # rejections, rolled back
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_mixed_batch_with_opt_outs_sampling_and_plain_requests(reference):
    """Speculating, opted-out and sampled requests share steps; every greedy one still matches HF."""
    arch, path, other, prompts, expected = reference
    llm = spec_llm(path, other, "ngram", max_num_batched_tokens=24, block_size=4)
    params = [greedy(n, speculate=(i % 3 != 1)) for i, n in enumerate(MAX_TOKENS)]
    params += [SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)]
    outs = llm.generate(prompts + [prompts[0]], params)
    for out, exp, p in zip(outs, expected, params):
        assert out.token_ids == exp
        if p.speculate is False:
            assert out.spec.proposed == 0 and out.spec.events[0].event == "off"
    assert sum(o.spec.proposed for o in outs) > 0


def test_warm_prefix_cache_with_speculation(reference):
    """Twice the same prompts: the second pass hits blocks the first one cached (verified tokens only), same tokens."""
    arch, path, other, prompts, expected = reference
    llm = spec_llm(path, other, "ngram", max_num_batched_tokens=16, block_size=4)
    llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    warm = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    for prompt, out, exp in zip(prompts, warm, expected):
        assert out.token_ids == exp
        assert out.bill.cached_tokens == (len(prompt) - 1) // 4 * 4
    assert_cached_blocks_are_verified(llm.engine.kv, [p + e for p, e in zip(prompts, expected)])


def assert_cached_blocks_are_verified(kv, sequences: list[list[int]]) -> None:
    """Every hash in the prefix cache names a block of some request's real tokens (prompt + kept output)."""
    from twospeed.engine.kv_cache import hash_block_tokens

    bs = kv.block_size
    real = set()
    for seq in sequences:
        parent = None
        for i in range(len(seq) // bs):
            parent = hash_block_tokens(parent, seq[i * bs:(i + 1) * bs])
            real.add(parent)
    assert kv.num_cached_blocks > 0
    assert set(kv.pool.cached_blocks) <= real, "a block is cached under tokens no request kept"


@pytest.mark.parametrize("proposer", ["ngram", "other-draft"])
def test_preemption_with_speculation_recomputes_exactly(reference, proposer):
    arch, path, other, prompts, expected = reference
    llm = spec_llm(path, other, proposer, block_size=4, num_gpu_blocks=20, max_num_batched_tokens=16)
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert llm.engine.scheduler.num_preemptions > 0
    for out, exp in zip(outs, expected):
        assert out.token_ids == exp
        check_trace(out, preempted=out.num_preemptions > 0)
    assert llm.engine.kv.num_free_blocks == 20
    draft = getattr(llm.engine.speculator.proposer, "kv", None)
    llm.engine.step()  # the proposer lets go of finished requests on the next step
    assert draft is None or draft.num_free_blocks == draft.num_blocks


def test_logprobs_with_speculation_equal_plain(reference):
    arch, path, other, prompts, _ = reference
    plain = float32_llm(path, block_size=8, num_gpu_blocks=256)
    spec = spec_llm(path, other, "self-draft")
    params = [greedy(n, logprobs=2) for n in MAX_TOKENS]
    for a, b in zip(plain.generate(prompts, params), spec.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
        assert [list(lp.top) for lp in a.logprobs] == [list(lp.top) for lp in b.logprobs]


@pytest.mark.parametrize("proposer", ["ngram", "self-draft", "other-draft"])
def test_seeded_sampling_identical_with_and_without_speculation(reference, proposer):
    """Each emitted token consumes its position's own noise vector, so a seed gives the same tokens either way."""
    arch, path, other, prompts, _ = reference
    plain = float32_llm(path, block_size=8, num_gpu_blocks=256)
    spec = spec_llm(path, other, proposer, spec_auto_fallback=False)
    params = [SamplingParams(max_tokens=n, temperature=0.8, top_k=20, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i, n in enumerate(MAX_TOKENS)]
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.spec.proposed for o in b) > 0


# -- the demo model: text, grammars, stop strings ------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_pair():
    """The demo without and with speculation (prompt lookup, and the demo's own draft model), float32."""
    return (LLM("demo", dtype="float32", max_model_len=512, num_gpu_blocks=128),
            LLM("demo", dtype="float32", max_model_len=512, num_gpu_blocks=128, spec_method="ngram",
                prompt_lookup_min=1, spec_auto_fallback=False),
            LLM("demo", dtype="float32", max_model_len=512, num_gpu_blocks=128, spec_method="draft",
                draft_model="demo-draft", spec_auto_fallback=False))


TOOL = {"type": "object", "additionalProperties": False, "required": ["tool", "arguments"], "properties": {
    "tool": {"enum": ["lookup_order", "issue_refund", "escalate_ticket"]},
    "arguments": {"type": "object", "additionalProperties": False, "required": ["id"],
                  "properties": {"id": {"type": "string", "maxLength": 8}}}}}
EXAMPLES = ('Reply with one tool call. Examples: {"tool":"lookup_order","arguments":{"id":"A17"}} '
            '{"tool":"issue_refund","arguments":{"id":"B2"}} {"tool":"lookup_order","arguments":{"id":"C9"}} Now: ')


def test_structured_output_with_speculation_matches_plain(demo_pair):
    """A grammar masks the verify rows too: a draft it forbids is rejected, the document is the same."""
    plain, ngram, draft = demo_pair
    prompts = [EXAMPLES + "order 42", EXAMPLES + "refund", "hello"]
    params = [SamplingParams(max_tokens=48, temperature=0, structured=StructuredOutput(json=TOOL)),
              SamplingParams(max_tokens=48, temperature=0, structured=StructuredOutput(json=TOOL, jump_forward=False)),
              SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput(regex=r"(ab|cd){2,6}x"))]
    want = plain.generate(prompts, params)
    for llm in (ngram, draft):
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        for o in got:
            check_trace(o)
    assert sum(o.spec.proposed for o in ngram.generate(prompts, params)) > 0


def test_stop_strings_min_tokens_and_eos_with_speculation(demo_pair):
    """A stop inside a run of kept drafts ends the request there: the tokens after it are thrown away (billed as
    rejected), exactly as plain decoding would never have produced them."""
    plain, ngram, draft = demo_pair
    text = plain.generate(["the the the"], greedy(30))[0].text
    stop = text[len(text) // 3: len(text) // 3 + 3].strip() or text[:2]
    eos = plain.engine.tokenizer.eos_token_ids
    prompts = ["the the the", "one two one two one two", "x"]
    params = [SamplingParams(max_tokens=30, temperature=0, stop=[stop]),
              SamplingParams(max_tokens=20, temperature=0, min_tokens=5, stop_token_ids=sorted(eos)),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    want = plain.generate(prompts, params)
    for llm in (ngram, draft):
        got = llm.generate(prompts, params)
        for a, b in zip(want, got):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                           a.stop_reason)
            check_trace(b)
    assert want[0].finish_reason == "stop" and want[0].stop_reason == stop


def test_speculation_options_are_checked():
    from twospeed.config import EngineConfig

    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig.from_kwargs("demo", spec_method="draft")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig.from_kwargs("demo", spec_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(TypeError, match="speculative_config"):
        EngineConfig.from_kwargs("demo", speculative_config={"method": "ngram", "gamma": 3})
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="no")


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path):
    write_hf_checkpoint(tmp_path / "t", "llama")
    write_hf_checkpoint(tmp_path / "d", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tmp_path / "t"), skip_tokenizer_init=True, num_gpu_blocks=64, spec_method="draft",
            draft_model=str(tmp_path / "d"))


def test_vllm_style_speculative_config(reference):
    arch, path, other, prompts, expected = reference
    llm = float32_llm(path, num_gpu_blocks=256,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert llm.engine.config.spec.num_speculative_tokens == 3
    outs = llm.generate(prompts[:2], [greedy(n) for n in MAX_TOKENS[:2]])
    assert [o.token_ids for o in outs] == expected[:2]
    assert max(len(o.spec.proposed_per_position) for o in outs) <= 3


def test_draft_model_kv_rolls_back_by_counter(reference):
    """The draft's own KV of its rejected guesses is overwritten, never cached: a second pass gets the same drafts."""
    arch, path, other, prompts, expected = reference
    llm = spec_llm(path, other, "other-draft", spec_auto_fallback=False)
    first = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    llm.engine.step()
    second = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert [o.spec.accepted_per_position for o in first] == [o.spec.accepted_per_position for o in second]
    assert_cached_blocks_are_verified(llm.engine.speculator.proposer.kv, [p + e for p, e in zip(prompts, expected)])
    assert [o.token_ids for o in second] == expected
