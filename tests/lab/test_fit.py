"""Fitting a workload to the server's context before anything is sent: which lanes fit, which are capped and
which are scaled (expectations computed by hand from the built-in workloads' YAML), --strict-lengths refusing
instead, the margin kept when token counts are estimates, and every request the planner then builds fitting
with its max_tokens in the target's own tokens (requests, a job's calls and a trace's prompts)."""

import json

import pytest

from twospeed.engine.engine import resolve_model_path
from twospeed.lab.fit import RESERVE, Fit, fit_workload, job_history
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import PlanConfig, Planner
from twospeed.lab.workload import load_workload


@pytest.fixture(scope="module")
def counter():
    return TokenCounter(resolve_model_path("demo"))


def fit(name, context, exact=True, strict=False, scale=1.0):
    return fit_workload(load_workload(name), context, "test", scale, exact, strict)


def test_mixed_on_a_2048_token_context():
    """The issue's run: the agent lane's 2,000-token prefix + 100-400 new tokens + up to 96 output, and rag's
    4,000-8,000-token prompts, cannot fit 2,048 tokens; chat and nightly fit as drawn."""
    f = fit("mixed", 2048)
    assert {k: v.action for k, v in f.lanes.items()} == {"agent": "scaled", "rag": "scaled", "chat": "fits",
                                                         "nightly": "fits"}
    limit = 2048 - RESERVE - 96  # the longest prompt beside a 96-token answer
    agent, rag = f.lanes["agent"], f.lanes["rag"]
    assert (agent.prompt_max, agent.output_max) == (2400, 96) and (rag.prompt_max, rag.output_max) == (8000, 96)
    # agent: round(2000 s) + round(400 s) <= 1951 -> s = 0.813 (1626 + 325 = 1951); rag: round(8000 s) <= 1951 -> 0.243
    assert agent.scale == pytest.approx(0.813) and agent.prompt_max_after == 1951 <= limit
    assert rag.scale == pytest.approx(0.243) and rag.prompt_max_after == 1944
    assert f.lanes["chat"].scale == 1.0 and f.margin == 0
    lines = f.lines()
    assert lines[0] == "fit: 2,048-token context (test):" and len(lines) == 3
    assert lines[2] == ("  lane rag: prompts up to 8,000 tokens + up to 96 output (typical 6,000); prompt lengths "
                        "scaled 0.243x to 972-1,944 tokens")


def test_a_tail_over_the_context_is_capped_and_a_fitting_workload_is_left_alone():
    """regression's citations lane draws 1,200-2,400 tokens + 64 output: its typical 1,800 fits 2,048, its tail
    does not, so each prompt is capped at the context less its own max_tokens."""
    f = fit("regression", 2048)
    c = f.lanes["citations"]
    assert (c.action, c.scale, c.prompt_max_after) == ("capped", 1.0, 2048 - RESERVE - 64)
    assert f.limit(64) == 1983 and f.limit(10) == 2037
    assert {v.action for v in fit("regression", 4096).lanes.values()} == {"fits"}
    assert fit("tasks", 2048).lines() == ["fit: 2,048-token context (test): every request fits as drawn"]


def test_strict_lengths_refuses_and_names_the_lanes():
    with pytest.raises(ValueError) as e:
        fit("mixed", 2048, strict=True)
    msg = str(e.value)
    assert msg.startswith("--strict-lengths: lane agent: prompts up to 2,400 tokens + 96 output do not fit the "
                          "2,048-token context (test); lane rag: prompts up to 8,000 tokens + 96 output")
    assert "chat" not in msg and "drop --strict-lengths" in msg
    fit("tasks", 2048, strict=True)  # it fits: nothing to refuse


def test_no_context_stated_changes_nothing_and_says_so():
    f = fit("mixed", None)
    assert f.lanes == {} and f.limit(64) is None and f.scale("rag", 0.5) == 0.5
    assert "states no context length" in f.lines()[0] and "--max-model-len" in f.lines()[0]


def test_estimated_counts_keep_a_margin():
    f = fit("mixed", 2048, exact=False)
    assert f.margin == 205 and f.limit(96) == 2048 - 205 - RESERVE - 96  # ceil(10% of 2,048)
    assert f.lanes["rag"].prompt_max_after <= f.limit(96)
    assert "kept free" in f.lines()[0]


def test_a_job_lane_is_scaled_to_its_longest_history():
    """agent-jobs: 1,500 prefix + 150 task + 32 fixed; gather 40 + 64 + 24 and dumps 6,000 + 600 (+8 each); act
    30 + 64 + 24 + 40 + 8; verify 3 x (30 + 32 + 24) = 8,850 tokens at scale 1."""
    lane = load_workload("agent-jobs").lanes[0]
    assert job_history(lane.job, lane.prefix_tokens, 1.0, None, None) == (8850, 0)
    f = fit("agent-jobs", 4096)
    j = f.lanes["support-job"]
    assert j.action == "scaled" and j.prompt_max == 8850 and j.output_max == 64
    assert j.prompt_max_after <= f.limit(64)
    assert job_history(lane.job, lane.prefix_tokens, j.scale + 0.002, None, None)[0] > f.limit(64)  # the largest


def test_fit_round_trips_through_results_json():
    f = fit("mixed", 2048)
    back = Fit.from_dict(json.loads(json.dumps(f.as_dict())))
    assert back.lanes == f.lanes and back.context_length == 2048 and back.lines() == f.lines()


def test_every_planned_request_fits_in_the_targets_tokens(counter):
    context = 2048
    workload = load_workload("mixed")
    f = fit_workload(workload, context, "test", 1.0, counter.exact)
    planner = Planner(workload, PlanConfig(seed=1, salt="fit", fit=f), counter)
    plan = planner.open_loop(40, None)
    longest = {}
    for p in plan:
        n = counter.billed(p.prompt, workload.lane(p.lane).endpoint)
        assert n + p.max_tokens <= context - RESERVE, (p.lane, n, p.max_tokens)
        longest[p.lane] = max(longest.get(p.lane, 0), n)
    assert longest["rag"] > 1500 and longest["agent"] > 1700  # scaled to fit, not squashed


def test_every_job_call_fits(counter):
    workload = load_workload("agent-jobs")
    f = fit_workload(workload, 2048, "test", 1.0, counter.exact)
    planner = Planner(workload, PlanConfig(seed=2, salt="fit", fit=f), counter)
    for p in planner.open_loop(3, None):
        job = p.job
        while (call := job.next_call(0.0)) is not None:  # ContextFull would raise: the bound holds
            n = counter.billed(call.prompt or "", "completions", call.messages)
            assert n + call.max_tokens <= 2048 - RESERVE
            job.observed(job.answered(call, '{"tool": "lookup_order", "arguments": {"id": "A1"}}', True))


def test_a_trace_prompt_over_the_context_is_cut(counter, tmp_path):
    long_prompt = " ".join(["evidence"] * 3000)
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"t": 0.0, "prompt": long_prompt, "max_tokens": 50}) + "\n" +
                     json.dumps({"t": 0.5, "prompt": "short one", "max_tokens": 50}) + "\n")
    workload = load_workload(str(trace))
    f = fit_workload(workload, 1024, "test", 1.0, True, trace_prompts=lambda: [
        (counter.billed(t.prompt), t.max_tokens) for t in workload.trace])
    assert f.trace_capped == 1 and "trace: 1 prompts cut" in f.lines()[1]
    plan = Planner(workload, PlanConfig(fit=f), counter).open_loop(None, 10.0)
    assert counter.billed(plan[0].prompt) <= 1024 - RESERVE - 50 and plan[1].prompt == "short one"
    with pytest.raises(ValueError, match="--strict-lengths: 1 trace prompts"):
        fit_workload(workload, 1024, "test", 1.0, True, strict=True,
                     trace_prompts=lambda: [(counter.billed(t.prompt), t.max_tokens) for t in workload.trace])
