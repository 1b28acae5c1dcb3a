"""The lab's statistics against numpy on known samples, the bootstrap interval, Wilson intervals, SLO judging,
and the bill."""

import numpy as np
import pytest

from twospeed.lab import bill, stats
from twospeed.lab.results import judge_slo
from twospeed.lab.workload import SLO, Price


def test_summarize_matches_numpy():
    rng = np.random.default_rng(1)
    x = rng.lognormal(-3, 0.7, size=501)
    s = stats.summarize(x.tolist())
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(x, q), rel=1e-12)
    assert s["max"] == x.max() and s["n"] == 501 and s["mean"] == pytest.approx(x.mean())
    assert stats.summarize([1.0, 2.0, 3.0, 4.0])["p50"] == 2.5  # linear interpolation, as numpy
    assert stats.summarize([None, 3.0])["n"] == 1
    empty = stats.summarize([])
    assert empty["n"] == 0 and empty["p99"] is None and empty["p99_ci"] is None


def test_bootstrap_ci_brackets_the_estimate_and_narrows_with_n():
    rng = np.random.default_rng(2)
    small, big = rng.exponential(1, 100), rng.exponential(1, 4000)
    lo, hi = stats.bootstrap_ci(small, 99)
    assert lo <= np.percentile(small, 99) <= hi
    lo_b, hi_b = stats.bootstrap_ci(big, 50)
    assert lo_b <= np.log(2) <= hi_b  # the true median of Exp(1)
    assert (hi_b - lo_b) < (stats.bootstrap_ci(small, 50)[1] - stats.bootstrap_ci(small, 50)[0])
    assert stats.bootstrap_ci(small, 99) == stats.bootstrap_ci(small, 99)  # seeded: reproducible
    assert stats.bootstrap_ci([1.0], 99) is None


@pytest.mark.parametrize("level", [0.5, 0.8])
def test_bootstrap_ci_covers_the_true_percentile_at_its_level(level):
    """On simulated data with a known median (Exp(1): ln 2), the interval holds it in about `level` of the
    trials: 300 trials give a binomial standard error of 3% at 50%, 2.3% at 80%. A skewed interval (say the
    lower end at the (1 - level) percentile instead of (1 - level) / 2) covers 25% or 70% instead."""
    rng = np.random.default_rng(7)
    trials = 300
    hits = 0
    for t in range(trials):
        lo, hi = stats.bootstrap_ci(rng.exponential(1, 60), 50, level=level, resamples=400, seed=t)
        hits += lo <= np.log(2) <= hi
    assert abs(hits / trials - level) < 0.07, hits / trials


def test_proportion_ci_and_overlap():
    lo, hi = stats.proportion_ci(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)  # Wilson, 95%
    lo, hi = stats.proportion_ci(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    assert stats.proportion_ci(0, 0) is None
    assert stats.overlaps([0, 1], [1, 2]) and not stats.overlaps([0, 1], [1.5, 2])
    assert stats.overlaps(None, [0, 1]) is None


def test_judge_slo():
    slo = SLO(ttft_ms=500, itl_ms=50)
    assert judge_slo(slo, 0.4, 0.04, 3.0) == []
    assert judge_slo(slo, 0.6, 0.04, 3.0) == ["ttft"]
    assert judge_slo(slo, 0.4, 0.06, 3.0) == ["itl"]
    assert judge_slo(slo, None, None, None) == ["ttft"]
    window = SLO(completion_window_s=10)
    assert judge_slo(window, 9.0, 1.0, 9.5) == [] and judge_slo(window, 0.1, 0.0, 10.5) == ["completion_window"]


def test_bill_sources_and_money():
    server = {"bill": {"prompt_tokens": 100, "cached_tokens": 64, "prefilled_tokens": 36, "output_tokens": 10}}
    usage = {"prompt_tokens": 100, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 32}}
    assert bill.request_bill(usage, server, 90, 9, True)["cached_tokens"] == 64  # the server's own bill wins
    b = bill.request_bill(usage, None, 90, 9, False)
    assert b == {"prompt_tokens": 100, "cached_tokens": 32, "prefilled_tokens": 68, "output_tokens": 10,
                 "goodput_tokens": 0, "forced_tokens": 0}
    assert bill.request_bill(None, {"bill": {**server["bill"], "forced_tokens": 4}}, 0, 0, True)["forced_tokens"] == 4
    assert bill.request_bill(None, None, 90, 9, True)["goodput_tokens"] == 9
    m = bill.money({"prefilled_tokens": 1_000_000, "cached_tokens": 2_000_000, "output_tokens": 500_000},
                   Price(3.0, 0.3, 15.0))
    assert m["total_usd"] == pytest.approx(3.0 + 0.6 + 7.5)
    assert bill.kv_bytes_per_token({"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
                                    "hidden_size": 512}) == 2 * 8 * 4 * 64 * 2
    kv = bill.kv_memory(10, 16, 8192)
    assert kv["cached_tokens_held"] == 160 and kv["cached_kv_bytes"] == 160 * 8192
    assert Price.parse("1,0.1,2") == Price(1.0, 0.1, 2.0)
    with pytest.raises(ValueError, match="INPUT,CACHED,OUTPUT"):
        Price.parse("1,2")
