"""The dashboard's parts without a server or a browser: the ring buffer against a list, the history's cursor
and bounds (a soak held to its stated memory cap by tracemalloc), its totals against the Prometheus counters
fed the same events, histogram buckets against exact percentiles (Prometheus's histogram_quantile, as
Prometheus computes it), the engine listeners, and the calibrated costs mapped onto the toy clock.
"""

from __future__ import annotations

import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from twospeed.engine.engine_stats import StepStats
from twospeed.engine.request import Request, percentile
from twospeed.engine.sampling_params import SamplingParams
from twospeed.plan.clock import ToyClock
from twospeed.serving.events import FaultEvent, FinishEvent, LoadEvent, StepEvent
from twospeed.server.history import History, HistoryConfig
from twospeed.server.metrics import ITL_BUCKETS, TTFT_BUCKETS, ServerMetrics
from twospeed.server.ring import ColumnRing
from twospeed.server.routes_dashboard import calibrated_costs
from twospeed.schema.slo import CAUSES, Verdict


# -- the ring ------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 9), stamps=st.lists(st.integers(0, 30), max_size=40), since=st.integers(-1, 31))
def test_ring_since_equals_the_tail_of_a_list(capacity, stamps, since):
    ring, kept = ColumnRing(("x", "y"), capacity), []
    for i, s in enumerate(sorted(stamps)):
        ring.append(float(s), (i, None if i % 3 == 0 else -i))
        kept.append((float(s), float(i), math.nan if i % 3 == 0 else float(-i)))
    expect = [k for k in kept[-capacity:] if k[0] > since] if kept else []
    t, (x, y) = ring.since(since)
    assert t == [k[0] for k in expect] and x == [k[1] for k in expect]
    assert [v if v == v else "nan" for v in y] == [k[2] if k[2] == k[2] else "nan" for k in expect]
    assert len(ring) == min(len(stamps), capacity) and ring.nbytes == 8 * capacity * 3


# -- events -------------------------------------------------------------------------------------------------
def finished(i: int, output: int = 20, cached: int = 16, scheduled: bool = True) -> Request:
    """A request that ran: prompt 48 (cached + prefilled), `output` tokens 10 ms apart."""
    r = Request(f"cmpl-{i:032x}-0", list(range(48)), SamplingParams(max_tokens=output), arrival_time=float(i),
                max_output_tokens=output)
    if scheduled:
        r.clock.first_scheduled, r.clock.prefill_done = i + 0.01 * (i % 7), i + 0.1
        r.bill.cached_tokens, r.bill.prefilled_tokens = cached, 48 - cached
    for k in range(output):
        r.append_token(3, i + 0.15 + 0.01 * k * (1 + i % 3))
    r.clock.finished = i + 1.0
    return r


def verdict(i: int) -> Verdict:
    return Verdict("a", True) if i % 3 else Verdict("a", False, CAUSES[i % len(CAUSES)], ["itl_p99"])


def step(i: int, **extra) -> StepStats:
    return StepStats(time=float(i), step_time=0.02 + 0.001 * (i % 5), num_prefill_tokens=64 * (i % 2),
                     num_decode_tokens=4, num_running=4, num_waiting=i % 3, num_preempted=int(i % 50 == 0),
                     kv_blocks_used=10, kv_blocks_total=96, kv_cached_blocks=5, **extra)


def events(n: int):
    for i in range(n):
        yield StepEvent(step(i))
        aborted = i % 11 == 0
        request = finished(i, scheduled=i % 13 != 0)
        yield FinishEvent(("a", "b")[i % 2], request, aborted, None if aborted else verdict(i))
    yield LoadEvent({"a": 2}, {"b": 1}, 0.25, 7)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def test_history_totals_equal_the_prometheus_counters_fed_the_same_events():
    history, metrics = History(HistoryConfig(), clock=FakeClock()), ServerMetrics("m", lanes=("a", "b"))
    for e in events(300):
        history.on_event(e)
        metrics.on_event(e)
    data = history.since()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}

    def prom(name, **labels):
        return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())

    for lane in ("a", "b"):
        t = data["totals"][lane]
        assert t["cached_tokens"] == prom("twospeed_prompt_tokens_total", lane=lane, kind="cached")
        assert t["prefilled_tokens"] == prom("twospeed_prompt_tokens_total", lane=lane, kind="prefilled")
        assert t["prefix_queries"] == prom("twospeed_prefix_cache_queries_total", lane=lane)
        assert t["output_tokens"] == prom("twospeed_generation_tokens_total", lane=lane)
        assert t["goodput_tokens"] == prom("twospeed_goodput_tokens_total", lane=lane) > 0
        assert t["preemptions"] == prom("twospeed_num_preemptions_total", lane=lane)
        slo = data["slo"][lane]
        assert slo.get("met", 0) == prom("twospeed_slo_requests_total", lane=lane, result="met") > 0
        for cause in CAUSES:
            assert slo.get(cause, 0) == prom("twospeed_slo_requests_total", lane=lane, cause=cause)
    assert data["load"] == {"running": {"a": 2}, "waiting": {"b": 1}, "kv_usage": 0.25, "cached_blocks": 7}
    assert prom("twospeed_kv_cache_usage_ratio") == 0.25 and prom("twospeed_num_requests_waiting", lane="b") == 1
    # gaps: every gap of every sequence that finished (not aborted), per lane, exact
    gaps = [(lane, g) for lane, g in zip(data["gaps"]["lane"], data["gaps"]["gap"])]
    assert len(gaps) == prom("twospeed_inter_token_latency_seconds_count")
    assert len(data["requests"]) == 300 and len(data["steps"]["t"]) == 300


def test_history_since_is_a_cursor_and_serves_only_its_minutes():
    clock = FakeClock()
    history = History(HistoryConfig(minutes=1.0), clock=clock)
    evs = list(events(40))
    for e in evs[:40]:
        history.on_event(e)
    first = history.since()
    for e in evs[40:]:
        history.on_event(e)
    second = history.since(first["now"])  # exactly what came after the first reply
    assert len(first["requests"]) + len(second["requests"]) == 40
    assert len(first["steps"]["t"]) + len(second["steps"]["t"]) == 40
    assert all(t > first["now"] for t in second["steps"]["t"])
    assert len(history.since(-0.005)["steps"]["t"]) < 40  # negative: the last 5 ms only
    clock.t += 61.0  # a minute later: nothing is served any more, even from the beginning of time
    empty = history.since(0)
    assert empty["requests"] == [] and empty["steps"]["t"] == [] and empty["gaps"]["gap"] == []
    assert empty["totals"] == second["totals"]  # the totals since start stay


def test_history_memory_stays_under_its_stated_cap_in_a_soak():
    config = HistoryConfig(max_steps=4096, max_gaps=8192, max_requests=1500)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        history = History(config)
        for i in range(6000):  # four times the requests it keeps, 40k gaps, 6000 steps
            history.on_event(StepEvent(step(i)))
            history.on_event(FinishEvent("lane" + str(i % 5), finished(i), False, verdict(i)))
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    data = history.since()
    assert len(data["requests"]) == 1500 and len(data["steps"]["t"]) == 4096 and len(data["gaps"]["gap"]) == 8192
    assert used <= history.memory_cap, (used, history.memory_cap)
    # the defaults: ~26 MB whatever the traffic (speculation's three step series take 1.6 MB of it)
    assert History().memory_cap < 25 << 20


def test_a_failing_listener_is_logged_and_the_others_still_hear(caplog):
    from twospeed.serving.engine_loop import EngineLoop

    heard = []
    loop = EngineLoop(None, None, listeners=[lambda e: 1 / 0, heard.append])
    loop._emit(FaultEvent("request"))
    assert heard == [FaultEvent("request")] and "listener" in caplog.text


# -- buckets ------------------------------------------------------------------------------------------------
def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (le, count) buckets, +Inf last (promql/quantile.go)."""
    total = buckets[-1][1]
    rank = q * total
    i = next(k for k, (_, c) in enumerate(buckets) if c >= rank)
    if math.isinf(buckets[i][0]):
        return buckets[i - 1][0]
    lo, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
    hi, count = buckets[i]
    return lo + (hi - lo) * (rank - below) / (count - below)


def hq_tolerance(ttfts: list[float]) -> float:
    """How far histogram_quantile's p99 may be from the exact one here: a bucket's width (10%) of the value,
    plus the gap between the two largest values, which the two definitions interpolate differently with few
    samples (with eight, the exact p99 sits at rank 6.93 of 0..7 and Prometheus's at rank 7.92 of 8)."""
    top = sorted(ttfts)
    return 0.10 * top[-1] + (top[-1] - top[-2])


def buckets_of(metrics: ServerMetrics, name: str, **labels) -> list[tuple[float, float]]:
    for f in text_string_to_metric_families(metrics.render().decode()):
        rows = [(float(s.labels["le"]), s.value) for s in f.samples
                if s.name == name + "_bucket" and labels.items() <= s.labels.items()]
        if rows:
            return sorted(rows)
    raise KeyError(name)


@pytest.mark.parametrize("hist, lo, hi", [("ttft", 0.002, 30.0), ("itl", 0.002, 1.0)])
def test_buckets_are_fine_where_slos_live(hist, lo, hi):
    bounds = TTFT_BUCKETS if hist == "ttft" else ITL_BUCKETS
    inside = [b for b in bounds if lo <= b <= hi * 1.1]
    assert inside[0] == lo and inside[-1] >= hi
    assert max(b / a for a, b in zip(inside, inside[1:])) < 1.1  # a bucket at most 10% wide


@pytest.mark.parametrize("hist, medians", [("ttft", (0.03, 0.2, 1.5, 8.0)), ("itl", (0.006, 0.03, 0.15, 0.4))])
def test_histogram_quantile_p99_is_within_10_percent_of_the_exact_p99(hist, medians):
    rng = random.Random(17)
    for median in medians:
        metrics = ServerMetrics("m")
        values = [median * math.exp(rng.gauss(0, 0.35)) for _ in range(3000)]
        child = getattr(metrics, hist).labels("a", "m")
        for v in values:
            child.observe(v)
        name = {"ttft": "twospeed_time_to_first_token_seconds", "itl": "twospeed_inter_token_latency_seconds"}[hist]
        est = histogram_quantile(0.99, buckets_of(metrics, name, lane="a"))
        exact = percentile(sorted(values), 99)
        assert abs(est - exact) <= 0.10 * exact, (median, est, exact)


def test_the_exposition_is_generate_latests_text_byte_for_byte():
    from prometheus_client import generate_latest

    metrics = ServerMetrics("m", lanes=("a", "b"))
    metrics.set_spec(3)
    before = metrics.render()  # the label cache is filled here, the values change after
    assert before == generate_latest(metrics.registry)
    for e in events(300):
        metrics.on_event(e)
    metrics.add_lane('we"ird\\lane\n')  # label values escaped as prometheus_client escapes them
    assert metrics.render() == generate_latest(metrics.registry) != before


def test_known_lanes_and_kinds_are_exported_at_zero_before_any_traffic():
    text = ServerMetrics("m", lanes=("default", "chat")).render().decode()
    for line in ('twospeed_prompt_tokens_total{kind="cached",lane="chat",model="m"} 0.0',
                 'twospeed_generation_tokens_total{lane="default",model="m"} 0.0',
                 'twospeed_slo_requests_total{cause="decode_interference",lane="chat",model="m",result="missed"} 0.0',
                 'twospeed_step_tokens_count{kind="prefill",model="m"} 0.0',
                 'twospeed_time_to_first_token_seconds_count{lane="chat",model="m"} 0.0',
                 'twospeed_num_preemptions_total{lane="chat",model="m"} 0.0'):
        assert line in text


# -- calibrated costs for the clock ----------------------------------------------------------------------------
class FakeCostModel:
    key = "cpu/bfloat16"
    num_observed = 12
    coefficients = {"step": 4e-3, "prefill_tokens": 3e-5, "prefill_attention": 1e-9, "decode_tokens": 2e-4,
                    "decode_context": 5e-8, "sampled": 1e-4}

    def predict(self, prefill=0, pairs=0, decode=0, context=0, sampled=0) -> float:
        c = self.coefficients
        n = (prefill or decode) and 1
        return (c["step"] * n + c["prefill_tokens"] * prefill + c["prefill_attention"] * pairs
                + c["decode_tokens"] * decode + c["decode_context"] * context + c["sampled"] * sampled)


def test_calibrated_costs_give_the_toy_clock_what_the_cost_model_predicts():
    class Engine:
        cost_model = FakeCostModel()

    costs = calibrated_costs(Engine())
    toy = costs["toy"]
    clock = ToyClock(toy["a"], toy["b"], toy["step"], toy["per_cached_token"])
    model = Engine.cost_model
    for n in (1, 37, 1000):  # one prompt alone in a step: n rows attending n(n+1)/2 pairs, one sampled row
        assert toy["prefill_fixed"] + clock.prefill_time(n) == pytest.approx(
            model.predict(prefill=n, pairs=n * (n + 1) // 2, sampled=1), rel=1e-12)
    for c in (0, 100, 5000):  # one decode row over c cached tokens (it attends c + 1 positions)
        assert clock.step_time(c) == pytest.approx(model.predict(decode=1, context=c + 1, sampled=1), rel=1e-12)
    assert calibrated_costs(object()) == {"available": False,
                                          "reason": "this engine has no calibrated step cost model"}
