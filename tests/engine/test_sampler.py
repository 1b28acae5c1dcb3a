"""Sampling and stopping: the sampler alone on fixed logits, then the engine on a tiny checkpoint,
then stop strings with the demo model's tokenizer.

The sampler draws exactly from softmax(logits / T) restricted by top-k, top-p and min-p; a seed
makes a request's tokens independent of its batch and of preemption; min_tokens hides EOS and
stop_token_ids; logprobs describe the raw model distribution.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import float32_llm, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.engine.request import Request
from twospeed.engine.sampler import Sampler

CPU = torch.device("cpu")


def make_req(params: SamplingParams, sampler: Sampler | None = None, *, eos=frozenset(), num_outputs: int = 0,
             rid: str = "r") -> Request:
    req = Request(rid, [1], params, eos_token_ids=frozenset(eos), max_output_tokens=1000)
    req.output_token_ids = [7] * num_outputs
    if params.seed is not None:
        req.generator = (sampler or Sampler(CPU)).make_generator(params.seed)
    return req


def allowed_mask(logits: torch.Tensor, p: SamplingParams, tol: float = 1e-5) -> torch.Tensor:
    """The filters' kept set, computed apart from the sampler (float64, one token at a time). tol > 0: also the
    tokens within tol of a boundary and ties (what the sampler may keep); tol < 0: only the tokens clear of
    every boundary and tie (what it must keep). tol = 0: the exact set, for logits without ties."""
    z = logits.float() / torch.tensor(p.temperature)
    vocab = z.numel()
    ok = torch.isfinite(z)
    if 0 < p.top_k < vocab:
        ok &= z >= z.topk(p.top_k).values[-1]
    probs = torch.where(ok, z, torch.tensor(float("-inf"))).double().softmax(-1)
    if p.top_p < 1.0:
        # in the nucleus iff the mass more likely than the token is below top_p; a tie may sort either way
        if tol >= 0:
            above = torch.stack([probs[probs > probs[i]].sum() for i in range(vocab)])
        else:
            above = torch.stack([probs[probs >= probs[i]].sum() - probs[i] for i in range(vocab)])
        ok &= above < p.top_p + tol
    if p.min_p > 0:
        ok &= (z - z.max()).double() >= math.log(p.min_p) - tol  # the most likely token survives top-k and top-p
    if tol < 0:  # a token e^-80 below the top has probability 0 in float32 (the sampler's softmax) anyway
        ok &= (z - z.max()).double() > -80
    return ok


def expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) renormalised over the allowed set (no ties in the logits used with this)."""
    z = (logits.double() / p.temperature)
    z = torch.where(allowed_mask(logits, p, tol=0.0), z, torch.tensor(float("-inf"), dtype=torch.float64))
    return z.softmax(-1)


def draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    req = make_req(params)
    tokens, _ = sampler(logits.expand(n, -1).clone(), [req] * n)
    return torch.tensor(tokens)


# --- the sampler on fixed logits -------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0, 0.7])


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.5, min_p=0.3),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}")
def test_empirical_frequencies_match_the_filtered_softmax(p):
    n = 20_000
    tokens = draw(Sampler(CPU, seed=123), LOGITS, p, n)
    freq = torch.bincount(tokens, minlength=LOGITS.numel()).double() / n
    exp = expected_probs(LOGITS, p)
    for i, (f, e) in enumerate(zip(freq.tolist(), exp.tolist())):
        if e == 0:
            assert f == 0, f"token {i} is filtered out but was drawn"
        else:
            assert abs(f - e) <= 5 * math.sqrt(e * (1 - e) / n) + 1e-3, f"token {i}: {f:.4f} vs {e:.4f}"


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-12, 12, allow_nan=False, width=32), min_size=2, max_size=40),
    temperature=st.floats(0.05, 3.0),
    top_k=st.one_of(st.just(0), st.integers(1, 45)),  # each filter off often enough for the others to show
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_filters_keep_exactly_the_reference_set(logits, temperature, top_k, top_p, min_p, seed):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    x = torch.tensor(logits)
    kept = Sampler.filtered_probs(x[None], [make_req(p)])[0] > 0
    must, may = allowed_mask(x, p, tol=-1e-5), allowed_mask(x, p, tol=1e-5)
    ids = lambda mask: mask.nonzero().flatten().tolist()  # noqa: E731
    assert not (must & ~kept).any(), f"dropped {ids(must & ~kept)}; kept {ids(kept)}"
    assert not (kept & ~may).any(), f"kept {ids(kept & ~may)} beyond {ids(may)}"
    tokens = draw(Sampler(CPU, seed=seed), x, p, 64)
    assert all(kept[t] for t in tokens.tolist()), f"emitted {tokens.tolist()} outside {ids(kept)}"


def test_greedy_is_the_argmax_and_top_k_1_equals_greedy():
    sampler = Sampler(CPU, seed=0)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
              SamplingParams(temperature=1.0, min_p=1.0)):
        tokens, _ = sampler(logits, [make_req(p) for _ in range(6)])
        assert tokens == argmax, p


def test_seeded_rows_do_not_depend_on_the_batch():
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    rng = torch.Generator().manual_seed(1)
    logits = [torch.randn(40, generator=rng) for _ in range(30)]

    def run(batch_size: int, position: int) -> list[int]:
        sampler = Sampler(CPU, seed=batch_size)
        req = make_req(p, sampler)
        others = [make_req(SamplingParams(temperature=1.0, seed=s if s % 2 else None), sampler)
                  for s in range(batch_size - 1)]
        out = []
        for x in logits:
            reqs = others[:position] + [req] + others[position:]
            rows = torch.randn(batch_size, 40, generator=rng)
            rows[position] = x
            tokens, _ = sampler(rows, reqs)
            out.append(tokens[position])
        return out

    alone = run(1, 0)
    assert run(5, 2) == alone and run(9, 8) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_min_tokens_masks_eos_and_stop_token_ids():
    sampler = Sampler(CPU, seed=0)
    logits = torch.zeros(32)
    logits[2], logits[5], logits[9] = 12.0, 11.0, 4.0  # 2 = EOS and 5 = a stop id dominate
    eos = {2}
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[5])
        for done in range(3):
            reqs = [make_req(p, eos=eos, num_outputs=done) for _ in range(2000 if temperature else 1)]
            tokens, _ = sampler(logits.expand(len(reqs), -1).clone(), reqs)
            assert not {2, 5} & set(tokens), (temperature, done)
        tokens, _ = sampler(logits[None].clone(), [make_req(p, eos=eos, num_outputs=3)])
        if temperature == 0:
            assert tokens == [2]  # min_tokens reached: EOS is allowed again
    # ignore_eos: the request carries no EOS ids, so only stop_token_ids are masked
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    req = Request("r", [1], p, eos_token_ids=frozenset(eos), max_output_tokens=10)
    assert sampler(logits[None].clone(), [req])[0] == [2]


def _reference_adjust(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """logit_bias, then repetition (prompt and output: divide a positive logit, multiply a negative one), then
    frequency and presence (output): vLLM's order and OpenAI's / HF's definitions, token by token."""
    out = list(row)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    return out


VOCAB = 12
_penalty_params = st.builds(
    lambda fp, pp, rp, bias: SamplingParams(temperature=0.0, frequency_penalty=fp, presence_penalty=pp,
                                            repetition_penalty=rp, logit_bias=bias or None),
    st.floats(-2, 2), st.floats(-2, 2), st.floats(0.1, 3.0),
    st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=VOCAB, max_size=VOCAB), st.lists(st.integers(0, VOCAB - 1), min_size=1,
       max_size=6), st.lists(st.integers(0, VOCAB - 1), max_size=8), _penalty_params,
       st.lists(st.integers(0, VOCAB - 1), max_size=3))
def test_logit_bias_and_penalties_match_the_reference_and_greedy_takes_their_argmax(row, prompt, output, p, draft):
    """Each row adjusted exactly as the token-by-token reference; a plain row beside it untouched; in verify, row j
    counts the drafts before it as output."""
    req = Request("r", prompt, p, max_output_tokens=64)
    req.output_token_ids.extend(output)
    plain = Request("q", prompt, SamplingParams(temperature=0.0), max_output_tokens=64)
    plain.output_token_ids.extend(output)
    logits = torch.tensor([row, row], dtype=torch.float64)
    adjusted = Sampler._adjust(logits, [req, plain])
    expected = _reference_adjust(row, prompt, output, p)
    assert torch.allclose(adjusted[0], torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-9)
    assert torch.equal(adjusted[1], logits[1])
    tokens, _ = Sampler(CPU)(logits.float(), [req, plain])
    exp = torch.tensor(expected, dtype=torch.float32)
    assert exp[tokens[0]] == exp.max()
    rows = [req] * (len(draft) + 1)
    before = [draft[:j] for j in range(len(draft) + 1)]
    verify = Sampler._adjust(torch.tensor([row] * len(rows), dtype=torch.float64), rows, before)
    for j in range(len(rows)):
        ref = _reference_adjust(row, prompt, output + draft[:j], p)
        assert torch.allclose(verify[j], torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-9)


def test_logprobs_are_of_the_raw_distribution():
    sampler = Sampler(CPU, seed=0)
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(3)) * 3
    logits[:, 4] = 20.0  # banned below min_tokens, so never sampled, yet it stays in the reported logprobs
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, top_k=5, logprobs=5),
              SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1, logprobs=0, min_tokens=2, stop_token_ids=[4]),
              SamplingParams(temperature=1.0, seed=4, logprobs=1, min_tokens=2, stop_token_ids=[4]),
              SamplingParams(temperature=1.0)]
    reqs = [make_req(p, sampler) for p in params]
    raw = logits.clone()
    tokens, lps = sampler(logits, reqs)
    assert torch.equal(logits, raw)  # the caller's logits are not modified
    ref = torch.log_softmax(raw, -1)
    assert lps[4] is None
    for i in range(4):
        lp, tok, n = lps[i], tokens[i], params[i].logprobs
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        assert len(lp.top) == n
        values = list(lp.top.values())
        assert values == sorted(values, reverse=True)
        top = ref[i].topk(n) if n else None
        if n:
            assert list(lp.top) == top.indices.tolist()
            assert values == pytest.approx(top.values.tolist(), abs=1e-6)
    assert tokens[0] == 4 and lps[0].rank == 1
    assert tokens[2] != 4 and tokens[3] != 4 and lps[2].rank > 1 and 4 in lps[3].top


# --- the engine on a tiny checkpoint ---------------------------------------------------------------

VOCAB = 301


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = write_hf_checkpoint(path, "llama")
    return str(path), model


def engine_llm(path, **kw) -> LLM:
    return float32_llm(path, **{"block_size": 4, "num_gpu_blocks": 128, **kw})


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


SEEDED = SamplingParams(seed=7, temperature=1.0, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True)


def test_seeded_sampling_reproducible_alone_batched_and_preempted(tiny):
    path, _ = tiny
    target = prompt(0, 11)
    alone = engine_llm(path).generate([target], SEEDED)[0].token_ids
    assert len(alone) == 16 and len(set(alone)) > 4

    others = [prompt(i, n) for i, n in zip(range(1, 6), (3, 17, 8, 25, 5))]
    other_params = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True),
                    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                    SamplingParams(temperature=1.0, seed=8, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True),
                    SamplingParams(temperature=0.6, top_k=5, max_tokens=4, ignore_eos=True),
                    SamplingParams(temperature=1.5, min_p=0.05, max_tokens=30, ignore_eos=True)]
    llm = engine_llm(path, max_num_batched_tokens=7)
    outs = llm.generate(others[:2] + [target] + others[2:], other_params[:2] + [SEEDED] + other_params[2:])
    assert outs[2].token_ids == alone
    assert outs[4].token_ids != alone  # same params but seed 8, a different prompt too

    # fcfs preempts the latest arrival: the target comes last onto a pool too small for everyone.
    pick = [0, 1, 4]
    for caching in (True, False):
        llm = engine_llm(path, num_gpu_blocks=12, max_num_batched_tokens=8, enable_prefix_caching=caching)
        outs = llm.generate([others[i] for i in pick] + [target], [other_params[i] for i in pick] + [SEEDED])
        assert outs[-1].num_preemptions > 0 and outs[-1].bill.recomputed_tokens > 0
        assert outs[-1].token_ids == alone
        assert llm.engine.kv.num_free_blocks == 12


def test_different_seeds_give_different_outputs(tiny):
    path, _ = tiny
    llm = engine_llm(path)
    target = prompt(0, 11)
    seeds = [7, 8, 9, 10]
    outs = llm.generate([target] * len(seeds), [SamplingParams(seed=s, temperature=1.0, top_p=0.9, top_k=20,
                                                               max_tokens=16, ignore_eos=True) for s in seeds])
    assert len({tuple(o.token_ids) for o in outs}) == len(seeds)
    again = llm.generate([target], SEEDED)[0]
    assert again.token_ids == outs[0].token_ids


def test_greedy_is_argmax_of_the_model_and_degenerate_filters_are_greedy(tiny):
    path, model = tiny
    llm = engine_llm(path)
    target = prompt(3, 9)
    greedy = llm.generate([target], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([target + greedy])).logits[0].float()
    assert logits[len(target) - 1:-1].argmax(-1).tolist() == greedy
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=0.7, min_p=1.0), SamplingParams(temperature=1.0, top_k=1, seed=5)):
        p.max_tokens, p.ignore_eos = 10, True
        assert llm.generate([target], p)[0].token_ids == greedy, p


def test_engine_logprobs_match_the_model(tiny):
    path, model = tiny
    llm = engine_llm(path, max_num_batched_tokens=5)
    target = prompt(4, 8)
    p = SamplingParams(temperature=0.8, top_k=5, seed=3, logprobs=4, max_tokens=8, ignore_eos=True)
    out = llm.generate([target], p)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([target + out.token_ids])).logits[0].float(), -1)
    assert len(out.logprobs) == 8
    for i, lp in enumerate(out.logprobs):
        row = ref[len(target) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)  # raw, not T-scaled or top-k'd
        values = list(lp.top.values())
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert list(lp.top) == row.topk(4).indices.tolist()
    assert any(lp.rank > 1 for lp in out.logprobs)  # it sampled, not only argmax


def test_stop_token_ids_min_tokens_eos_and_length(tiny):
    path, _ = tiny
    llm = engine_llm(path)
    target = prompt(5, 7)
    g = llm.generate([target], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert g.finish_reason == "length" and len(g.token_ids) == 12 and g.stop_reason is None
    g = g.token_ids
    j = next(i for i in range(2, 12) if g[i] not in g[:i])

    out = llm.generate([target], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[g[j]],
                                                ignore_eos=True))[0]
    assert out.token_ids == g[:j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == g[j]

    # min_tokens: g[0] is the argmax of the first step but may not be chosen before 3 tokens exist
    out = llm.generate([target], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3,
                                                stop_token_ids=[g[0]], ignore_eos=True))[0]
    assert len(out.token_ids) >= 3 and g[0] not in out.token_ids[:3]
    assert out.token_ids[0] != g[0]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == g[0] and out.stop_reason == g[0] and g[0] not in out.token_ids[:-1]

    # EOS (the tokenizer-less engine reads it from config.json; here set on the request directly)
    engine = llm.engine
    for min_tokens, expect in ((0, g[:j + 1]), (j, g[:j + 1])):
        req = engine.add_request(None, target, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=min_tokens))
        req.eos_token_ids = frozenset({g[j]})
        while not req.is_finished:
            engine.step()
        assert req.output_token_ids == expect and req.finish_reason == "stop" and req.stop_reason is None
    req = engine.add_request(None, target, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=j + 2))
    req.eos_token_ids = frozenset({g[j]})
    while not req.is_finished:
        engine.step()
    assert g[j] not in req.output_token_ids[:j + 2]

    out = llm.generate([target], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == g[:4] and out.finish_reason == "length" and out.stop_reason is None
    assert engine.kv.num_free_blocks == 128


# --- stop strings on the demo model ----------------------------------------------------------------

DEMO_PARAMS = dict(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_run():
    llm = LLM("demo", num_gpu_blocks=64)
    tok = llm.tokenizer
    prompt_text = "The cat"
    base = llm.generate([prompt_text], SamplingParams(**DEMO_PARAMS))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    text, ids = base.text, base.token_ids
    # The text after each output token, from the tokenizer, so a stop string can straddle a token edge.
    prompt_ids = tok.encode(prompt_text)
    head = tok.decode(prompt_ids)
    edges = []
    for j in range(1, len(ids)):
        prefix = tok.decode(prompt_ids + ids[:j])[len(head):]
        assert text.startswith(prefix)
        edges.append((j, len(prefix)))
    for j, b in edges:
        # two characters each side of the edge between output tokens j-1 and j; token j must add >= 2 chars
        nxt = dict(edges).get(j + 1, len(text))
        stop = text[b - 2:b + 2]
        if b >= 3 and nxt - b >= 2 and len(stop) == 4 and text.find(stop) == b - 2 and text.count(stop) == 1 \
                and j + 2 < len(ids):
            return llm, prompt_text, text, ids, j, b, stop
    pytest.fail(f"no stop string straddling a token edge in {text!r}")


def test_stop_string_across_a_token_edge(demo_run):
    llm, prompt_text, text, ids, j, b, stop = demo_run
    params = [SamplingParams(**DEMO_PARAMS, stop=[stop]),
              SamplingParams(**DEMO_PARAMS, stop=[stop], include_stop_str_in_output=True),
              SamplingParams(**DEMO_PARAMS, stop=["never-in-this-text", stop])]
    cut, keep, two = llm.generate([prompt_text] * 3, params)
    for out in (cut, keep, two):
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == ids[:j + 1]  # generation ends with the token that completed the stop string
    assert cut.text == text[:b - 2] == two.text
    assert keep.text == text[:b + 2]


def test_stop_string_before_min_tokens_is_not_a_stop(demo_run):
    """BUG (engine.py _check_stop + tokenizer.py IncrementalDetokenizer): with min_tokens past the
    stop string, generation rightly continues (as in vLLM), but the detokenizer already recorded
    stop_hit and cut output_text at the stop string, and drops every later token's text, so the
    request ends by length with text truncated at a stop that did not stop it."""
    llm, prompt_text, text, ids, j, b, stop = demo_run
    out = llm.generate([prompt_text], SamplingParams(**DEMO_PARAMS, stop=[stop], min_tokens=j + 2))[0]
    assert out.token_ids == ids
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == text
