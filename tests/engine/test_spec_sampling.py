"""Speculative sampling preserves the target distribution: chi-square tests of the sampler's verification
against exact distributions, then of the whole engine on a tiny-vocabulary checkpoint against HF's own
probabilities.

Each test draws a fixed sample under a fixed seed (deterministic), bins the outcomes, merges bins expected
below 5, and requires a chi-square p-value above 1e-3 (a correct sampler fails one such test in a thousand
seeds; these seeds pass, and a sampler that drops or biases a rejected draft's residual fails by orders of
magnitude: the last test shows one). The p-value is the regularised upper incomplete gamma Q(dof/2, stat/2).
"""

from __future__ import annotations

import pytest
import torch

from conftest import float32_llm, write_hf_checkpoint
from twospeed import SamplingParams
from twospeed.engine.request import Request
from twospeed.engine.sampler import Sampler
from test_sampler import expected_probs

CPU = torch.device("cpu")
P_MIN = 1e-3
FILTERS = {"T1": dict(temperature=1.0), "T0.7-top_k3": dict(temperature=0.7, top_k=3),
           "T1-top_p0.8": dict(temperature=1.0, top_p=0.8), "T1.3-min_p0.2": dict(temperature=1.3, min_p=0.2)}


def chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """p-value of observed counts against expected probabilities (cells expected below 5 merged into one)."""
    if not set(counts) <= {k for k, p in expected.items() if p > 0}:
        return 0.0  # an outcome of probability 0 was drawn
    cells, small_obs, small_exp = [], 0, 0.0
    for key, p in expected.items():
        if p * n < 5:
            small_obs, small_exp = small_obs + counts.get(key, 0), small_exp + p * n
        else:
            cells.append((counts.get(key, 0), p * n))
    if small_exp > 0:
        cells.append((small_obs, small_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- the sampler alone: two rows, one draft ------------------------------------------------------------------
ROW0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
ROW1 = torch.tensor([-0.5, 0.3, 1.7, 0.2, 0.9, -2.0])


def verify_many(params: SamplingParams, draft: int, n: int, seed: int = 0) -> dict:
    """n requests verify one draft against rows (ROW0, ROW1); count the emitted sequences (1 or 2 tokens)."""
    sampler = Sampler(CPU, seed=seed)
    reqs = [Request(f"r{i}", [1], params, max_output_tokens=100) for i in range(n)]
    logits = torch.stack([ROW0, ROW1] * n)
    tokens, _ = sampler.verify(logits, reqs, [[draft]] * n)
    counts: dict = {}
    for t in tokens:
        counts[tuple(t)] = counts.get(tuple(t), 0) + 1
    return counts


def exact_sequences(params: SamplingParams, draft: int) -> dict:
    """A plain sampler's distribution of what one verify step emits: token t ~ p0; if t is the draft, then p1."""
    p0, p1 = expected_probs(ROW0, params), expected_probs(ROW1, params)
    out = {(t,): float(p0[t]) for t in range(len(ROW0)) if t != draft}
    out.update({(draft, u): float(p0[draft] * p1[u]) for u in range(len(ROW1))})
    return out


@pytest.mark.parametrize("name", sorted(FILTERS))
@pytest.mark.parametrize("draft", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_verification_emits_the_target_distribution(name, draft):
    params = SamplingParams(**FILTERS[name])
    n = 12_000
    p = chi_square_p(verify_many(params, draft, n), exact_sequences(params, draft), n)
    assert p > P_MIN, f"{name}, draft {draft}: p = {p:.2e}"


def test_the_test_catches_a_biased_residual():
    """A verifier that, on a rejection, draws from p itself instead of the residual (p without the draft) emits the
    wrong distribution; the same test on its (exactly sampled) outcomes fails by far."""
    params = SamplingParams(temperature=1.0)
    p0, p1 = expected_probs(ROW0, params).tolist(), expected_probs(ROW1, params).tolist()
    d, reject = 0, 1 - p0[0]
    biased = {(t,): reject * p0[t] for t in range(6)}  # (d,) alone: the rejected draft drawn again
    biased.update({(d, u): p0[d] * p1[u] for u in range(6)})
    keys = list(biased)
    n = 12_000
    draws = torch.multinomial(torch.tensor([biased[k] for k in keys], dtype=torch.float64), n, replacement=True,
                              generator=torch.Generator().manual_seed(1))
    counts: dict = {}
    for i in draws.tolist():
        counts[keys[i]] = counts.get(keys[i], 0) + 1
    assert chi_square_p(counts, exact_sequences(params, d), n) < 1e-6


# -- the engine on a tiny vocabulary -----------------------------------------------------------------------
VOCAB = 5
PROMPT = [3, 1, 4, 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A target of a 5-token vocabulary (and the target as HF sees it); its draft is itself, greedy, so its guess
    is the target's most likely token: kept with probability p(guess) under the filters, rejected otherwise."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    model = write_hf_checkpoint(root / "target", "llama", vocab_size=VOCAB, seed=3)
    return root, model


def exact_last_two(model, params: SamplingParams) -> dict:
    """P(t2, t3) of a 3-token answer to PROMPT, summed over t1, under params' filters (HF's logits)."""
    out: dict = {}
    with torch.no_grad():
        def probs(seq):
            return expected_probs(model(torch.tensor([seq])).logits[0, -1].float(), params).double()
        p1 = probs(PROMPT)
        for t1 in range(VOCAB):
            if p1[t1] == 0:
                continue
            p2 = probs(PROMPT + [t1])
            for t2 in range(VOCAB):
                if p2[t2] == 0:
                    continue
                p3 = probs(PROMPT + [t1, t2])
                for t3 in range(VOCAB):
                    out[(t2, t3)] = out.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return out


@pytest.mark.parametrize("name", ["T1", "T0.7-top_k3", "T1-top_p0.8"])
def test_engine_speculative_sampling_preserves_the_distribution(tiny, name):
    """2,000 three-token answers with a draft model proposing the second (kept or rejected; the third is the verify
    step's own token or the next step's): the second and third tokens' joint distribution is the target's."""
    root, model = tiny
    params = SamplingParams(max_tokens=3, ignore_eos=True, **FILTERS[name])
    llm = float32_llm(root / "target", seed=11, max_num_seqs=256, num_gpu_blocks=1100, block_size=4,
                      spec_method="draft", draft_model=str(root / "target"), spec_auto_fallback=False)
    n = 2000
    outs = llm.generate([PROMPT] * n, params)
    proposed = sum(o.spec.proposed for o in outs)
    accepted = sum(o.spec.accepted for o in outs)
    assert proposed > n // 2 and 0 < accepted < proposed  # both paths taken often
    counts: dict = {}
    for o in outs:
        key = tuple(o.token_ids[1:])
        counts[key] = counts.get(key, 0) + 1
    p = chi_square_p(counts, exact_last_two(model, params), n)
    assert p > P_MIN, f"{name}: p = {p:.2e}"
