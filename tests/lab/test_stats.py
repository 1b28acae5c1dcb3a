"""The lab's statistics against numpy on known samples, the bootstrap interval, Wilson intervals, SLO judging,
and the bill."""

import math
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed.lab import bill, stats
from twospeed.lab.report import spec_line
from twospeed.lab.results import _steps, judge_slo, spec_summary
from twospeed.lab.client import Timing
from twospeed.lab.workload import Price
from twospeed.schema.clock import Bill, Clock
from twospeed.schema.slo import LaneSLO


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


def test_bootstrap_ci_is_the_seeded_percentile_bootstrap():
    """Exactly the documented procedure: 1000 resamples with replacement under default_rng(seed), the q-th
    percentile of each, then the (1 - level) / 2 and (1 + level) / 2 percentiles of those estimates."""
    x = np.random.default_rng(5).lognormal(0, 1, 37)
    for q, level, seed in [(50, 0.95, 0), (99, 0.9, 3)]:
        idx = np.random.default_rng(seed).integers(0, len(x), size=(1000, len(x)))
        est = np.percentile(x[idx], q, axis=1)
        expected = np.percentile(est, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
        assert stats.bootstrap_ci(x.tolist(), q, level=level, seed=seed) == tuple(expected)
    assert stats.bootstrap_ci(x, 50, seed=1) != stats.bootstrap_ci(x, 50, seed=0)
    # two values are enough; every observation can be drawn (the first one too)
    assert stats.bootstrap_ci([1.0, 0.0], 50) == (0.0, 1.0)
    assert stats.bootstrap_ci([0.0, 1.0], 50) == (0.0, 1.0)


def test_summarize_fields_and_seed():
    x = np.random.default_rng(6).exponential(1, 50).tolist()
    s = stats.summarize(x, seed=4)
    assert set(s) == {"n", "mean", "p50", "p90", "p99", "max", "p50_ci", "p99_ci"}
    assert s["p50_ci"] == list(stats.bootstrap_ci(x, 50, seed=4))
    assert s["p99_ci"] == list(stats.bootstrap_ci(x, 99, seed=4))
    assert stats.summarize(x)["p50_ci"] == list(stats.bootstrap_ci(x, 50, seed=0))
    assert stats.summarize([2])["p50"] == 2.0 and stats.summarize([2])["p50_ci"] is None
    assert stats.summarize([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None,
                                   "p50_ci": None, "p99_ci": None}


def test_proportion_ci_and_overlap():
    lo, hi = stats.proportion_ci(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)  # Wilson, 95%
    lo, hi = stats.proportion_ci(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    assert stats.proportion_ci(0, 0) is None
    assert stats.proportion_ci(20, 20) == [pytest.approx(1 - 0.1611, abs=1e-4), 1.0]
    # 99%: z from the normal quantile, apart from the code's table
    z = NormalDist().inv_cdf(0.995)
    centre = (0.5 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.25 / 10 + z * z / 400) / (1 + z * z / 10)
    assert stats.proportion_ci(5, 10, level=0.99) == [pytest.approx(centre - half, abs=1e-6),
                                                      pytest.approx(centre + half, abs=1e-6)]
    assert stats.overlaps([0, 1], [1, 2]) and not stats.overlaps([0, 1], [1.5, 2])
    assert stats.overlaps([1, 2], [0, 1]) and stats.overlaps([0, 5], [1, 2]) and stats.overlaps([1, 2], [0, 5])
    assert not stats.overlaps([1.5, 2], [0, 1])
    assert stats.overlaps(None, [0, 1]) is None and stats.overlaps([0, 1], []) is None


def timing(ttft: float, gaps: list[float]) -> Timing:
    times = [ttft + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    itl = [b - a for a, b in zip(times, times[1:])]  # as the client reconstructs them
    return Timing(ttft, times[-1], None, itl, [], times, len(times), "chunks")


def test_judge_slo_names_misses_as_the_server_does():
    slo = LaneSLO.from_workload("a", {"ttft_p99_ms": 500, "itl_p99_ms": 50})
    assert judge_slo(slo, timing(0.4, [0.04] * 10)) == []
    assert judge_slo(slo, timing(0.6, [0.04] * 10)) == ["ttft_p99"]
    assert judge_slo(slo, timing(0.4, [0.06] * 10)) == ["itl_p99"]
    assert judge_slo(slo, timing(0.4, [])) == []  # one token: no gap to judge
    window = LaneSLO.from_workload("b", {"completion_window_s": 10})
    assert judge_slo(window, timing(9.0, [0.5])) == [] and judge_slo(window, timing(0.1, [10.4])) == ["ttlt"]
    assert window.attainment_target == 0.99 and window.workload_dict() == {
        "ttft_p99_ms": None, "itl_p99_ms": None, "completion_window_s": 10.0, "target": 0.99}
    with pytest.raises(ValueError, match="unknown SLO keys"):
        LaneSLO.from_workload("c", {"ttft_ms": 500})


@settings(max_examples=200)
@given(ttft=st.floats(0.001, 5.0), gaps=st.lists(st.floats(0.0, 0.5), max_size=40),
       ttft_ms=st.none() | st.floats(1, 3000), itl_ms=st.none() | st.floats(1, 300), window=st.none() | st.floats(0.1, 20))
def test_the_lab_and_the_server_judge_the_same_times_alike(ttft, gaps, ttft_ms, itl_ms, window):
    """One judge: the lab's verdict on what its client timed equals the server's (LaneSLO.judge) on a clock with the
    same token times, and the planner's (the same LaneSLO) by construction."""
    slo = LaneSLO.from_workload("a", {"ttft_p99_ms": ttft_ms, "itl_p99_ms": itl_ms, "completion_window_s": window})
    t = timing(ttft, gaps)
    clock = Clock(0.0, first_scheduled=0.0, prefill_done=ttft, first_token=ttft, token_times=t.token_times,
                  finished=t.ttlt)
    server = slo.judge(clock, Bill(), 0)
    assert judge_slo(slo, t) == server.missed and (not server.missed) == server.met


def test_bill_sources_and_money():
    server = {"bill": {"prompt_tokens": 100, "cached_tokens": 64, "prefilled_tokens": 36, "output_tokens": 10}}
    usage = {"prompt_tokens": 100, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 32}}
    assert bill.request_bill(usage, server, 90, 9, True)["cached_tokens"] == 64  # the server's own bill wins
    b = bill.request_bill(usage, None, 90, 9, False)
    assert b == {"prompt_tokens": 100, "cached_tokens": 32, "prefilled_tokens": 68, "output_tokens": 10,
                 "goodput_tokens": 0, "forced_tokens": 0, "spec_proposed": 0, "spec_accepted": 0}
    assert bill.request_bill(None, {"bill": {**server["bill"], "forced_tokens": 4}}, 0, 0, True)["forced_tokens"] == 4
    spec = bill.request_bill(None, {"bill": {**server["bill"], "spec_proposed": 12, "spec_accepted": 7}}, 0, 0, True)
    assert (spec["spec_proposed"], spec["spec_accepted"]) == (12, 7)  # speculation's drafts, from the server's bill
    assert bill.request_bill(None, None, 90, 9, True)["goodput_tokens"] == 9
    # usage without some fields: the client's counts; no cached count is 0
    assert bill.request_bill({"prompt_tokens_details": None}, None, 90, 9, True) == {
        "prompt_tokens": 90, "cached_tokens": 0, "prefilled_tokens": 90, "output_tokens": 9, "goodput_tokens": 9,
        "forced_tokens": 0, "spec_proposed": 0, "spec_accepted": 0}
    assert bill.request_bill(None, {"bill": None}, 7, 2, False)["cached_tokens"] == 0
    m = bill.money({"prefilled_tokens": 1_000_000, "cached_tokens": 2_000_000, "output_tokens": 500_000},
                   Price(3.0, 0.3, 15.0))
    assert m == {"input_usd": pytest.approx(3.0), "cached_input_usd": pytest.approx(0.6),
                 "output_usd": pytest.approx(7.5), "total_usd": pytest.approx(3.0 + 0.6 + 7.5)}
    assert bill.money({"prefilled_tokens": 1, "cached_tokens": 1, "output_tokens": 1}, Price(1e6, 2e6, 4e6)) == {
        "input_usd": 1.0, "cached_input_usd": 2.0, "output_usd": 4.0, "total_usd": 7.0}
    cfg = {"num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 512}
    assert bill.kv_bytes_per_token(cfg) == 2 * 8 * 4 * 64 * 2
    assert bill.kv_bytes_per_token({**cfg, "num_key_value_heads": None}, dtype_bytes=4) == 2 * 8 * 8 * 64 * 4
    assert bill.kv_bytes_per_token({**cfg, "head_dim": 80}) == 2 * 8 * 4 * 80 * 2
    odd = bill.kv_bytes_per_token({**cfg, "hidden_size": 500})  # 500 // 8 = 62 per head: an integer count
    assert odd == 2 * 8 * 4 * 62 * 2 and isinstance(odd, int)
    assert bill.kv_bytes_per_token({"num_attention_heads": 8}) is None
    assert bill.kv_memory(10, 16, 8192) == {"cached_blocks": 10, "block_size": 16, "cached_tokens_held": 160,
                                            "kv_bytes_per_token": 8192, "cached_kv_bytes": 160 * 8192}
    assert bill.kv_memory(10.0, 16, None) == {"cached_blocks": 10, "block_size": 16, "cached_tokens_held": 160,
                                              "kv_bytes_per_token": None, "cached_kv_bytes": None}
    assert bill.kv_memory(None, 16, 8192) == {"cached_blocks": None, "block_size": 16, "cached_tokens_held": None,
                                              "kv_bytes_per_token": 8192, "cached_kv_bytes": None}
    assert Price.parse("1,0.1,2") == Price(1.0, 0.1, 2.0)
    with pytest.raises(ValueError, match="INPUT,CACHED,OUTPUT"):
        Price.parse("1,2")


def test_steps_per_token_and_speculation_summary():
    """Steps from the server's clock (decode steps + the prefill's sample), else one per streamed chunk (a peer);
    the summary sums drafts over the records that have them and divides steps by the tokens of those with steps."""
    assert _steps({"decode_steps": 4}, None) == 5
    chunks = type("T", (), {"chunk_gaps": [0.1, 0.2, 0.1], "output_tokens": 9})()
    assert _steps({}, chunks) == 4
    records = [{"steps": 5, "output_tokens": 12, "spec_proposed": 16, "spec_accepted": 7, "spec_verify_steps": 4},
               {"steps": 10, "output_tokens": 10, "spec_proposed": 0, "spec_accepted": 0, "spec_verify_steps": None},
               {"steps": None, "output_tokens": 3}]
    s = spec_summary(records)
    assert s == {"proposed": 16, "accepted": 7, "verify_steps": 4, "acceptance_rate": 7 / 16,
                 "mean_acceptance_length": 1 + 7 / 4, "steps_per_token": 15 / 22}
    assert spec_summary([{"steps": None, "output_tokens": 0}])["steps_per_token"] is None
    doc = {"lanes": {"agent": {"spec": s}, "quiet": {"spec": spec_summary([])},
                     "peer": {"spec": {**spec_summary(records[1:2]), "proposed": 0}}}}
    assert spec_line(doc) == ("decode: agent 0.68 steps/token, 7/16 drafts kept (44%), acceptance length 2.75; "
                              "peer 1.00 steps/token")
    assert spec_line({"lanes": {"quiet": {"spec": spec_summary([])}}}) is None
