"""Agent jobs in the lab: the job lane's YAML, prompt construction turn by turn (history grows append-only, the
prefix stays byte-stable, parallel tool results in call order, summarized dumps capped), exact prompt lengths
in the target's tokens, the harness policies, traced jobs, and the job clock (its parts sum to the wall time;
calls strictly one after another) against a canned streaming server."""

import asyncio
import json
import time

import httpx
import pytest

from twospeed.engine.engine import resolve_model_path
from twospeed.lab import job_results, results
from twospeed.lab.client import stream_request
from twospeed.lab.job_prompt import History
from twospeed.lab.job_runner import JobRun, run_job
from twospeed.lab.job_script import ContextFull
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import PlanConfig, Planner
from twospeed.lab.workload import BUILTIN, Price, load_workload, parse_workload

TOOL_CALL = '{"tool": "lookup_order", "arguments": {"id": "A1"}}'


@pytest.fixture(scope="module")
def counter():
    return TokenCounter(resolve_model_path("demo"))


def _job_lane(**job):
    base = {"task_tokens": 20, "tools": {"a": {"latency_ms": 5, "observation_tokens": 300},
                                         "b": {"latency_ms": 15, "observation_tokens": 40}},
            "steps": [{"name": "gather", "prompt_tokens": 12, "max_tokens": 8, "tools": ["a", "b"]},
                      {"name": "act", "prompt_tokens": 10, "max_tokens": 8},
                      {"name": "verify", "prompt_tokens": 9, "max_tokens": 4, "repeat": {"max": 3, "until": "gate"},
                       "gate": {"type": "json"}}]}
    base.update(job)
    return {"name": "j", "kind": "job", "prefix_tokens": 200, "job": base}


def _planner(counter, lane=None, endpoint="completions", **cfg):
    lane = dict(lane or _job_lane(), endpoint=endpoint)
    return Planner(parse_workload({"lanes": [lane]}), PlanConfig(seed=0, salt="s1", **cfg), counter)


def _drive(job, answers):
    """Run a job script by hand: each call answered by the next answer, tools observed at once."""
    calls = []
    while (call := job.next_call(0.0)) is not None:
        calls.append(call)
        answer = answers[min(len(calls) - 1, len(answers) - 1)]
        batch = job.answered(call, answer, answer.startswith("{"))
        job.observed(batch)
    return calls


def test_builtin_agent_jobs_and_bad_jobs():
    w = load_workload("agent-jobs")
    assert "agent-jobs" in BUILTIN and w.lanes[0].kind == "job"
    spec = w.lanes[0].job
    assert [s.name for s in spec.steps] == ["gather", "act", "verify"] and spec.window_s == 60
    assert spec.steps[0].tools == ["search_knowledge_base", "lookup_order"] and spec.steps[2].repeat.max == 3
    assert spec.steps[2].gate.latency_ms.min == 50 and "latency_ms" not in spec.steps[2].gate.config
    with pytest.raises(ValueError, match="not defined under job.tools"):
        parse_workload({"lanes": [_job_lane(steps=[{"name": "x", "tools": ["nope"]}])]})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_workload({"lanes": [_job_lane(steps=[{"name": "x", "promt_tokens": 3}])]})
    with pytest.raises(ValueError, match="kind: job"):
        parse_workload({"lanes": [{"name": "x", "kind": "chat", "job": {"steps": [{"name": "a"}]}}]})
    with pytest.raises(ValueError, match="unknown gate"):
        parse_workload({"lanes": [_job_lane(steps=[{"name": "x", "gate": {"type": "vibes"}}])]})


def test_history_grows_append_only_and_prefix_stays(counter):
    planner = _planner(counter)
    job = planner.open_loop(2, None)[0].job
    calls = _drive(job, ["A1", "A2", "not json", '{"ok": 1}'])
    assert [c.step for c in calls] == ["gather", "act", "verify", "verify"]  # verify looped until its gate passed
    prefix = planner.prefixes["j"]
    assert prefix.startswith("[run s1]\n")
    for prev, cur in zip(calls, calls[1:]):
        assert cur.prompt.startswith(prefix) and cur.prompt.startswith(prev.prompt)  # byte for byte
    assert "ASSISTANT:A1\nTOOL a RESULT: " in calls[1].prompt
    # parallel results concatenated in call order (a before b), then the next instruction
    a, b = calls[1].prompt.index("TOOL a RESULT"), calls[1].prompt.index("TOOL b RESULT")
    assert a < b < calls[1].prompt.index("STEP act:")
    assert calls[1].observations == [300, 40] and calls[2].observations == []
    grow = [counter.billed(c.prompt) for c in calls]
    assert grow == sorted(grow) and grow[1] - grow[0] > 340  # the answer + 340 observation tokens + instruction
    again = _drive(_planner(counter).open_loop(2, None)[0].job, ["A1", "A2", "not json", '{"ok": 1}'])
    assert [c.prompt for c in again] == [c.prompt for c in calls]  # deterministic under the seed


def test_chat_history_renders_append_only(counter):
    job = _planner(counter, endpoint="chat").open_loop(1, None)[0].job
    calls = _drive(job, ["A1", "A2", '{"ok": 1}'])
    rendered = [counter.render_chat(c.messages) for c in calls]
    assert calls[0].messages[0]["role"] == "system" and calls[0].prompt is None
    for prev, cur in zip(rendered, rendered[1:]):
        assert cur.startswith(prev)  # the generation prompt is the start of the next assistant message
    assert [m["role"] for m in calls[1].messages] == ["system", "user", "assistant", "user"]
    assert calls[1].messages[3]["content"].startswith("TOOL a RESULT: ")


def test_summarize_caps_observations(counter):
    text = History("t").prompt("P", "s", "i")[0]
    assert text == "PTASK: t\nSTEP s: i\nASSISTANT:"
    cut = _drive(_planner(counter, summarize_dumps=64).open_loop(1, None)[0].job, ["A1", "A2", "{}"])
    assert cut[1].observations == [64, 40]  # the 300-token dump entered as its first 64 tokens; b was under the cap
    dump = cut[1].prompt.split("TOOL a RESULT: ")[1].split("\nTOOL b")[0]
    assert counter.count(dump) == 64
    whole = _drive(_planner(counter).open_loop(1, None)[0].job, ["A1", "A2", "{}"])
    assert counter.billed(whole[1].prompt) - counter.billed(cut[1].prompt) == pytest.approx(300 - 64, abs=2)
    model = _planner(counter, _job_lane(summarize={"max_tokens": 64, "by": "model"}))
    calls = _drive(model.open_loop(1, None)[0].job, ["A1", "SHORT SUMMARY", "A2", "{}"])
    assert [c.kind for c in calls] == ["step", "summarize", "step", "step"]
    assert calls[1].max_tokens == 64 and "RESULT: " in calls[1].prompt and calls[1].observations == [300]
    assert "TOOL a RESULT: SHORT SUMMARY\nTOOL b RESULT" in calls[2].prompt
    assert model.policy(model.workload.lanes[0]) == {"prefix_stable": True, "summarize": {"max_tokens": 64, "by": "model"}}
    off = _planner(counter, _job_lane(summarize={"max_tokens": 32}), summarize_dumps=0)
    assert off.policy(off.workload.lanes[0])["summarize"] is None


def test_unstable_prefix_and_the_digest(counter):
    stable = _planner(counter)
    unstable = _planner(counter, unstable_prefix=True)
    first = unstable.open_loop(1, None)[0].job.next_call(1.5)
    later = unstable.open_loop(1, None)[0].job.next_call(62.25)
    assert "Current time: 2026-12-01 09:00:01.500" in first.prompt and "09:01:02.250" in later.prompt
    assert first.prompt[:20] == later.prompt[:20] and first.prompt != later.prompt
    assert not unstable.policy(unstable.workload.lanes[0])["prefix_stable"]
    yaml_off = parse_workload({"lanes": [dict(_job_lane(summarize={"max_tokens": 9}), prefix_stable=False,
                                              endpoint="completions")]})
    assert yaml_off.digest == stable.workload.digest  # runs differing only in harness policy stay comparable
    other = parse_workload({"lanes": [dict(_job_lane(), prefix_tokens=201, endpoint="completions")]})
    assert other.digest != stable.workload.digest


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompts_bill_exactly_what_the_lane_asks(counter, endpoint):
    """prefix_tokens + prompt_tokens, with the salt line, BOS and the chat wrapper inside the count: every
    built-in lane (rag's passages and agent's tool schemas included), and a lane asking for 240."""
    for name in ("mixed", "chat", "agent", "rag"):
        w = load_workload(name)
        w.lanes = [lane for lane in w.lanes if endpoint == "completions" or lane.kind != "nightly"]
        for lane in w.lanes:
            lane.endpoint = endpoint
        lanes = {lane.name: lane for lane in w.lanes}
        for p in Planner(w, PlanConfig(seed=3, salt="deadbeef"), counter).open_loop(30 if name != "rag" else 4, None):
            lane = lanes[p.lane]
            assert p.meta["prompt_tokens_asked"] >= lane.prefix_tokens + lane.prompt_tokens.min
            assert counter.billed(p.prompt, endpoint) == p.meta["prompt_tokens"] == p.meta["prompt_tokens_asked"]
    fixed = parse_workload({"lanes": [{"name": "x", "kind": "chat", "endpoint": endpoint, "prompt_tokens": 240},
                                      {"name": "y", "kind": "agent", "endpoint": endpoint, "prefix_tokens": 1200,
                                       "prompt_tokens": 240}]})
    for p in Planner(fixed, PlanConfig(salt="deadbeef"), counter).open_loop(8, None):
        assert counter.billed(p.prompt, endpoint) == (240 if p.lane == "x" else 1440)


def test_a_lane_asking_less_than_its_template_is_counted(counter):
    """A nightly row (its template alone is ~40 tokens here) asked for 20: sent at its minimum, and counted."""
    w = parse_workload({"lanes": [{"name": "n", "kind": "nightly", "prompt_tokens": 20}]})
    plan = Planner(w, PlanConfig(salt="deadbeef"), counter).open_loop(3, None)
    assert all(p.meta["prompt_tokens"] > p.meta["prompt_tokens_asked"] == 20 for p in plan)
    records = [{"prompt_tokens": p.meta["prompt_tokens"], "prompt_tokens_asked": 20} for p in plan]
    fit = results.prompt_fit(records + [{"prompt_tokens": 5, "prompt_tokens_asked": 5}])
    assert fit["asked"] == 4 and fit["off"] == 3 and fit["max_over"] == max(p.meta["prompt_tokens"] for p in plan) - 20


def test_context_cap_ends_the_job(counter):
    job = _planner(counter, max_prompt_tokens=400).open_loop(1, None)[0].job
    job.observed(job.answered(job.next_call(), "A1", True))
    with pytest.raises(ContextFull, match="over --max-prompt-tokens 400"):
        job.next_call()


# -- the job clock against a canned server -------------------------------------------------------------
def _server(calls_seen):
    """A twospeed-like SSE server: 3 tokens, a server clock (queue 2 ms), a bill from the request."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls_seen.append(body)
        text = TOOL_CALL if body.get("response_format") else "{\"ok\": 1}"
        ts = {"clock": {"queue_ms": 2.0, "prefill_ms": 3.0, "ttft_ms": 6.0, "decode_steps": 2, "interfered_steps": 0},
              "bill": {"prompt_tokens": len(body["prompt"]), "cached_tokens": 0, "prefilled_tokens": len(body["prompt"]),
                       "output_tokens": 3, "forced_tokens": 0}}
        events = [{"choices": [{"index": 0, "text": text[:1]}], "twospeed": {"num_tokens": 1, "emit_times": [1.0]}},
                  {"choices": [{"index": 0, "text": text[1:], "finish_reason": "stop"}],
                   "twospeed": {"num_tokens": 2, "emit_times": [1.01, 1.02]}},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "twospeed": ts}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    return handler


def _run_jobs(workload, planner, counter, n=1):
    seen = []

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_server(seen))) as client:
            t0 = time.perf_counter()

            async def send(p):
                return await stream_request(client, "http://test/v1", workload.lane(p.lane), p, "m", counter, t0)

            return [await run_job(p, send, t0) for p in planner.open_loop(n, None)]

    return asyncio.run(go()), seen


def _records(runs, workload, counter):
    out = []
    for run in runs:
        calls = [results.record(c, workload, counter) for c in run.calls]
        out.append((run, calls, job_results.job_record(run, calls, 30.0, workload.price)))
    return out


def test_job_clock_parts_sum_to_the_wall_time(counter):
    lane = _job_lane()
    lane["job"]["steps"][0]["gate"] = {"type": "json", "latency_ms": 20}
    lane["job"]["steps"][0]["response_format"] = {"type": "json_object"}
    lane["job"]["gate"] = {"type": "none", "latency_ms": 10}
    w = parse_workload({"lanes": [lane]})
    planner = Planner(w, PlanConfig(salt="s"), counter)
    runs, seen = _run_jobs(w, planner, counter)
    (run, calls, job), = _records(runs, w, counter)
    assert run.error is None and job["calls"] == 3 and [c["turn"] for c in calls] == [1, 2, 3]
    assert [c["step"] for c in calls] == ["gather", "act", "verify"] and all(c["job"] == 0 for c in calls)
    assert "response_format" in seen[0] and "response_format" not in seen[1]  # each step its own
    parts = sum(job[f"{p}_s"] for p in job_results.PARTS)
    assert parts == pytest.approx(job["wall_s"], abs=1e-9)  # the identity, by construction
    assert -1e-6 <= job["other_s"] <= 0.05 + 0.1 * job["wall_s"]  # and the lab attributed nearly all of it
    assert job["tool_s"] >= 0.015 and job["gate_s"] >= 0.03  # parallel tools: the slowest (15 ms); gates 20 + 10 ms
    assert job["queue_s"] <= 3 * 0.002 + 1e-9  # the server's queue, capped by each call's client TTFT
    for prev, cur in zip(run.calls, run.calls[1:]):  # strictly sequential: each call after the previous answer
        assert cur.sent >= prev.finished
    assert job["clock_source"] == "twospeed" and job["good"] and job["window_met"]
    assert job["prompt_tokens"] == sum(c["prompt_tokens"] for c in calls)
    assert [t["observation_tokens"] for t in job["turns"]] == [0, 340, 0]
    summary = job_results.jobs_summary([job], 30.0, 1.0, 0)
    assert summary["turns"][1]["observation_tokens"] == 340 and summary["goodput"]["jobs"] == 1
    assert sum(summary["share"].values()) == pytest.approx(1.0)


def test_job_record_arithmetic():
    """The split from hand-made call records: queue from the server, prefill = TTFT - queue, decode the rest."""
    from twospeed.lab.gates import GateResult
    from twospeed.lab.schedule import Planned

    def call(turn, ttft, call_s, queue, prompt, cached):
        return {"turn": turn, "step": "s", "error": None, "ttft_s": ttft, "ttlt_s": call_s, "call_s": call_s,
                "server_queue_s": queue, "server_ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
                "prefilled_tokens": prompt - cached, "output_tokens": 4, "goodput_tokens": 0, "forced_tokens": 0,
                "spec_proposed": 0, "spec_accepted": 0, "observation_tokens": 0}

    run = JobRun(Planned(7, "j", 1.0, "", 0), sent=1.5, finished=4.5, tool_s=0.6, gate_s=0.1, steps_passed=True,
                 job_gate=GateResult(True))
    calls = [call(1, 0.5, 0.9, 0.2, 100, 0), call(2, 0.4, 1.2, None, 300, 96)]
    j = job_results.job_record(run, calls, 2.0, Price())
    assert j["wall_s"] == pytest.approx(3.0) and j["queue_s"] == pytest.approx(0.2)
    assert j["prefill_s"] == pytest.approx(0.3 + 0.4) and j["decode_s"] == pytest.approx(0.4 + 0.8)
    assert j["other_s"] == pytest.approx(3.0 - 0.2 - 0.7 - 1.2 - 0.6 - 0.1)
    assert j["lag_s"] == pytest.approx(0.5) and not j["window_met"] and not j["good"]  # 3 s > the 2 s window
    assert j["clock_source"] == "twospeed" and j["prompt_tokens_per_turn"] == "100;300"
    assert (j["prompt_tokens"], j["cached_tokens"], j["prefilled_tokens"]) == (400, 96, 304)


def test_traced_jobs_replay_in_turn_order(tmp_path, counter):
    trace = tmp_path / "jobs.jsonl"
    lines = [{"t": 0.0, "job": "j1", "turn": 2, "prompt": "second", "max_tokens": 3},
             {"t": 0.0, "job": "j1", "turn": 1, "prompt": "first", "tool_s": 0.02, "lane": "agent"},
             {"t": 0.1, "prompt": "single"}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    w = load_workload(str(trace))
    assert w.source["jobs"] == 1 and w.source["requests"] == 1
    planner = Planner(w, PlanConfig(), counter)
    plan = planner.open_loop(None, 10.0)
    assert plan[0].job is not None and plan[1].job is None and plan[1].prompt == "single"
    runs, seen = _run_jobs(w, planner, counter)
    assert [b["prompt"] for b in seen] == ["first", "second"] and seen[1]["max_tokens"] == 3
    assert runs[0].tool_s >= 0.02 and runs[0].error is None


def test_prefix_check_names_the_timestamp(counter):
    """prefix-score over a lane's prompts as sent: stable prompts diverge after the prefix, stamped ones inside it."""
    from twospeed.lab import prefix_score

    def check(planner):
        plan = planner.open_loop(6, None)
        rendered = [prefix_score.render({"prompt": p.prompt}, counter.model_tokenizer) for p in plan]
        return prefix_score.lane_check(rendered, [p.meta["prefix"] for p in plan])

    lane = {"name": "a", "kind": "agent", "prefix_tokens": 1200, "prompt_tokens": 100}
    stable = check(Planner(parse_workload({"lanes": [lane]}), PlanConfig(salt="s"), counter))
    assert stable["declared_prefix_prompts"] == 6 and stable["unstable_prompts"] == 0
    assert stable["predicted_hit_rate"] > 0.7 and stable["first_unstable"] is None
    unstable = check(Planner(parse_workload({"lanes": [lane]}), PlanConfig(salt="s", unstable_prefix=True), counter))
    assert unstable["unstable_prompts"] == 5 and unstable["predicted_hit_rate"] < 0.05
    first = unstable["first_unstable"]
    assert first["context"].endswith("time: 2026-12-01 09:00:0") and first["char_offset"] < 60  # the seconds differ
