"""Arrival processes (rates and burstiness within tolerance), workloads as YAML, and the run plan: lanes
split by share, deterministic under a seed, prompts shaped (shared byte-stable prefix) and capped."""

import json

import numpy as np
import pytest

from twospeed.lab import arrivals
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import PlanConfig, Planner
from twospeed.lab.workload import BUILTIN, load_workload, parse_workload


@pytest.mark.parametrize("process, burstiness", [("poisson", 1.0), ("gamma", 2.5), ("gamma", 0.5), ("constant", 1.0)])
def test_rate_and_burstiness(process, burstiness):
    rng = np.random.default_rng(7)
    t = arrivals.offsets(rng, process, 4.0, n=20000, burstiness=burstiness)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    rate = (len(t) - 1) / t[-1]
    assert rate == pytest.approx(4.0, rel=0.05)
    expected_cv = 0.0 if process == "constant" else burstiness
    assert arrivals.burstiness_of(t) == pytest.approx(expected_cv, abs=0.06 * max(1, expected_cv))


def test_duration_mode():
    t = arrivals.offsets(np.random.default_rng(0), "poisson", 50.0, duration=100.0)
    assert t.max() < 100.0 and len(t) == pytest.approx(5000, rel=0.05)
    assert len(arrivals.offsets(np.random.default_rng(0), "constant", 2.0, duration=10.0)) == 20
    with pytest.raises(ValueError):
        arrivals.offsets(np.random.default_rng(0), "poisson", 1.0, n=3, duration=3.0)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrivals.gaps(np.random.default_rng(0), "uniform", 1.0, 3)


def test_builtin_workloads_load():
    for name in BUILTIN:
        w = load_workload(name)
        assert w.lanes and w.name == name
    assert {lane.name for lane in load_workload("mixed").lanes} == {"agent", "rag", "chat", "nightly"}
    assert load_workload("nightly").lanes[0].slo.workload_dict()["completion_window_s"] == 60


def test_bad_workloads_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="not a built-in"):
        load_workload("no-such-workload")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_workload({"lanes": [{"name": "a", "kind": "chat", "promt_tokens": 5}]})
    with pytest.raises(ValueError, match="kind must be"):
        parse_workload({"lanes": [{"name": "a", "kind": "poem"}]})
    with pytest.raises(ValueError, match="unique"):
        parse_workload({"lanes": [{"name": "a", "kind": "chat"}, {"name": "a", "kind": "rag"}]})
    with pytest.raises(ValueError, match="arrival process"):
        parse_workload({"lanes": [{"name": "a", "kind": "chat", "arrival": {"process": "burst"}}]})
    typo = tmp_path / "w.yaml"
    typo.write_text("lanes:\n  - name: a\n    kind: chat\n    arrival: {proces: poisson}\n")
    with pytest.raises(ValueError, match="w.yaml.*proces"):
        load_workload(str(typo))
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 0.5, "prompt": "b"}\n{"t": 0.0, "prompt": "a", "lane": "x", "max_tokens": 3}\n')
    w = load_workload(str(trace))
    assert [t.prompt for t in w.trace] == ["a", "b"] and {lane.name for lane in w.lanes} == {"x", "trace"}
    plan = Planner(w, PlanConfig(), TokenCounter()).open_loop(None, 10.0)
    assert [(p.offset, p.lane, p.max_tokens) for p in plan] == [(0.0, "x", 3), (0.5, "trace", 64)]
    trace.write_text('{"prompt": "no time"}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_workload(str(trace))


def _plan(seed=0, salt="s", n=40, **kw):
    planner = Planner(load_workload("mixed"), PlanConfig(seed=seed, salt=salt, **kw), TokenCounter())
    return planner, planner.open_loop(n, None)


def test_plan_is_deterministic_and_split_by_share():
    _, a = _plan()
    _, b = _plan()
    assert [(p.lane, p.offset, p.prompt, p.max_tokens) for p in a] == [(p.lane, p.offset, p.prompt, p.max_tokens)
                                                                      for p in b]
    _, c = _plan(seed=1)
    assert [p.prompt for p in a] != [p.prompt for p in c]
    counts = {lane: sum(p.lane == lane for p in a) for lane in ("agent", "rag", "chat", "nightly")}
    assert counts == {"agent": 14, "rag": 6, "chat": 10, "nightly": 10}
    assert [p.offset for p in a] == sorted(p.offset for p in a)
    _, fast = _plan(rate=100.0)
    assert max(p.offset for p in fast) < max(p.offset for p in a)


def test_prompts_are_shaped():
    planner, plan = _plan(n=300)
    agent = [p for p in plan if p.lane == "agent"]
    prefix = planner.prefixes["agent"]
    shared = [p for p in agent if p.prompt.startswith(prefix)]
    assert 0.8 <= len(shared) / len(agent) <= 0.97  # prefix_reuse 0.9: most reuse it, byte for byte
    assert all(p.prompt.startswith("[run s]\n") for p in plan)  # the salt comes first
    for p in (p for p in plan if p.lane == "rag"):
        assert len(p.meta["passage_ids"]) >= 2 and all(f"[{pid}]" in p.prompt for pid in p.meta["passage_ids"])
    json.loads(prefix.split("TOOLS:\n")[1])  # the tool schemas are real JSON
    _, other_salt = _plan(salt="t", n=60)
    assert other_salt[0].prompt != plan[0].prompt and other_salt[0].prompt[8:] == plan[0].prompt[8:]


def test_scale_and_caps():
    counter = TokenCounter()
    _, full = _plan(n=20)
    _, small = _plan(n=20, scale=0.25, max_prompt_tokens=900, max_output_tokens=50)
    assert sum(counter.count(p.prompt) for p in small) < 0.4 * sum(counter.count(p.prompt) for p in full)
    assert max(counter.count(p.prompt) for p in small) <= 900
    assert max(p.max_tokens for p in small) == 50
    with pytest.raises(ValueError, match="lower --scale"):
        _plan(n=10, max_prompt_tokens=200)
    with pytest.raises(ValueError, match="--scale"):
        PlanConfig(scale=0)


def test_closed_loop_stream_is_deterministic():
    planner = Planner(load_workload("mixed"), PlanConfig(seed=3), TokenCounter())
    it = planner.closed_loop()
    first = [next(it) for _ in range(12)]
    again = Planner(load_workload("mixed"), PlanConfig(seed=3), TokenCounter()).closed_loop()
    assert [(p.lane, p.prompt) for p in first] == [(p.lane, p.prompt) for p in (next(again) for _ in range(12))]
    assert all(p.offset is None for p in first) and len({p.lane for p in first}) > 1
