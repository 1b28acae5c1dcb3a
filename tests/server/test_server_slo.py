"""Lanes and SLOs: parsing --slo flags and YAML files, judging one request, attributing a miss. No server."""

from __future__ import annotations

import math

import pytest

from twospeed.engine.request import Bill, Clock
from twospeed.schema.slo import LaneSLO, Objective, SLOTable, load_slo_file, parse_duration, parse_slo_flag


def make_clock(queue=0.0, prefill=0.01, gaps=(0.01,) * 9, interfered=0) -> Clock:
    """A finished request's clock: arrival 0, first token right after prefill, then the given gaps."""
    c = Clock(arrival=0.0, first_scheduled=queue, prefill_done=queue + prefill)
    t = queue + prefill + 0.001
    c.first_token = t
    c.token_times = [t]
    for g in gaps:
        t += g
        c.token_times.append(t)
    c.finished = t
    c.decode_steps = len(gaps)
    c.interfered_steps = interfered
    return c


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("30s", 30.0), ("250us", 250e-6), ("2m", 120.0),
                                           ("1.5s", 1.5), ("1e3ms", 1.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["500", "fast", "-1s", "0ms", "5 hours"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_flag():
    slo = parse_slo_flag("drafting:ttft_p99=500ms,itl_p99=60ms")
    assert slo == LaneSLO("drafting", (Objective("ttft", 0.5, 99.0), Objective("itl", 0.06, 99.0)))
    assert [o.name for o in slo.objectives] == ["ttft_p99", "itl_p99"]
    nightly = parse_slo_flag("nightly:ttlt=30s,priority=5")
    assert nightly.objectives == (Objective("ttlt", 30.0),) and nightly.priority == 5


@pytest.mark.parametrize("spec, message", [
    ("drafting", "LANE:METRIC"), ("drafting:", "LANE:METRIC"), ("drafting:ttft", "METRIC=DURATION"),
    ("drafting:speed=5s", "unknown objective"), ("drafting:ttft_p0=5s", r"\(0, 100\]"),
    ("drafting:ttft=5", "unit"), ("bad lane:ttft=5s", "lane names"), ("x:priority=high", "integer")])
def test_bad_flags(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_slo_flag(spec)


def test_a_lanes_itl_target_is_its_tightest_itl_objective():
    """What the server hands the scheduler with each request (Request.itl_target)."""
    assert parse_slo_flag("chat:ttft_p99=1s,itl_p99=100ms,itl=300ms").itl_target == pytest.approx(0.1)
    assert parse_slo_flag("nightly:ttlt=30s").itl_target == math.inf  # objectives, none on ITL: no limit
    assert LaneSLO("default").itl_target is None  # no SLO: the engine's default target
    assert parse_slo_flag("batch:priority=3").itl_target is None


def test_yaml_file(tmp_path):
    path = tmp_path / "lanes.yaml"
    path.write_text("lanes:\n  drafting: {ttft_p99: 500ms, itl_p99: 60ms}\n  nightly:\n    ttlt: 30s\n")
    lanes = load_slo_file(path)
    assert [s.lane for s in lanes] == ["drafting", "nightly"]
    assert lanes[1].objectives == (Objective("ttlt", 30.0),)
    path.write_text("drafting: {ttft: 1s}\n")  # the `lanes:` key is optional
    assert load_slo_file(path)[0].objectives == (Objective("ttft", 1.0),)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_slo_file(path)


def test_lane_admission_bounds_label_sets():
    table = SLOTable([parse_slo_flag("drafting:ttft=1s")], max_lanes=1)
    assert table.admit(None).lane == "default"
    assert table.admit("drafting").objectives
    assert table.admit("batch").objectives == ()  # a lane without an SLO is fine
    assert table.admit("another").lane == "default" and table.overflowed == 1  # past the bound: the default lane
    assert table.admit("drafting").objectives and table.admit("batch").lane == "batch"  # known lanes keep theirs
    assert table.admit("yet-another").lane == "default" and table.overflowed == 2
    with pytest.raises(ValueError, match="lane names"):
        table.admit("a b")
    with pytest.raises(ValueError, match="twice"):
        SLOTable([parse_slo_flag("x:ttft=1s"), parse_slo_flag("x:ttlt=1s")])


def judge(spec: str, clock: Clock, bill: Bill | None = None, preemptions: int = 0):
    slo = parse_slo_flag(spec)
    return SLOTable([slo]).judge(slo.lane, clock, bill or Bill(prompt_tokens=10, prefilled_tokens=10), preemptions)


def test_met_and_lanes_without_slo():
    assert judge("a:ttft=1s,itl_p99=50ms,tpot=50ms,ttlt=2s", make_clock()).met
    assert SLOTable().judge("default", make_clock(queue=100), Bill(), 0).met


def test_miss_attributed_to_queue_or_prefill():
    v = judge("a:ttft=100ms", make_clock(queue=0.5, prefill=0.01))
    assert (v.met, v.cause, v.missed) == (False, "queue", ["ttft"])
    assert judge("a:ttft=100ms", make_clock(queue=0.01, prefill=0.5)).cause == "prefill"
    assert judge("a:queue=100ms", make_clock(queue=0.2)).cause == "queue"
    assert judge("a:ttlt=300ms", make_clock(queue=0.01, prefill=0.5)).cause == "prefill"


def test_decode_miss_with_and_without_interference():
    slow = (0.01,) * 6 + (0.2, 0.2, 0.2)  # three slow gaps
    assert judge("a:itl_p99=100ms", make_clock(gaps=slow, interfered=3)).cause == "decode_interference"
    assert judge("a:itl_p99=100ms", make_clock(gaps=slow, interfered=1)).cause == "decode"
    uniform = (0.2,) * 9  # every step slow: a big batch, not a prefill chunk
    assert judge("a:tpot=100ms", make_clock(gaps=uniform, interfered=0)).cause == "decode"
    assert judge("a:ttlt=500ms", make_clock(gaps=slow, interfered=3)).cause == "decode_interference"


def test_preemption_wins():
    """Each sign of a preemption alone makes it the cause; without either, the same miss is decode-side."""
    clock = make_clock(queue=0.5, gaps=(0.2,) * 5)
    spec = "a:ttft=100ms,ttlt=100ms"
    assert judge(spec, clock).cause == "decode"  # ttlt misses worst, and decode dominates it
    # preempted, but every block was still cached on readmission: nothing recomputed
    v = judge(spec, clock, Bill(prompt_tokens=10, prefilled_tokens=10), preemptions=1)
    assert v.cause == "preemption" and v.missed == ["ttft", "ttlt"]
    v = judge(spec, clock, Bill(prompt_tokens=10, prefilled_tokens=10, recomputed_tokens=12), preemptions=0)
    assert v.cause == "preemption"


def test_worst_objective_decides():
    # ttft misses by 2x (queue), itl by 10x (decode): the itl miss is the main one.
    v = judge("a:ttft=250ms,itl=20ms", make_clock(queue=0.5, gaps=(0.01, 0.2)))
    assert v.cause == "decode" and set(v.missed) == {"ttft", "itl"}


def test_objective_without_a_value_is_skipped():
    one_token = make_clock(gaps=())
    assert judge("a:tpot=1us,itl=1us", one_token).met
