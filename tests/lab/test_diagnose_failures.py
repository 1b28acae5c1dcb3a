"""The diagnosis of lanes whose requests failed, rule by rule on hand-built runs: a failed request is a miss, its
errors lead the verdict with class and count, the user-visible split says "no successful request" when there is
none, and no lane with failures is ever called fine. Error classes from the bodies real servers send."""

import pytest

from twospeed.lab import errors, results
from twospeed.lab.client import Chunk, Response, reconstruct
from twospeed.lab.diagnose import diagnose, diagnosis_lines
from twospeed.lab.lane_facts import lane_facts
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import Planned
from twospeed.lab.workload import load_workload

AGENT_SLO = {"ttft_p99_ms": 1500, "itl_p99_ms": 150}
VLLM_400 = ("HTTP 400: {\"error\":{\"message\":\"This model's maximum context length is 2048 tokens. However, you "
            "requested 2144 tokens (2049 in the messages, 95 in the completion). Please reduce the length of the "
            "messages or completion.\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}}")
LLAMA_400 = ("HTTP 400: {\"error\":{\"code\":400,\"message\":\"request (5120 tokens) exceeds the available context size "
             "(4096 tokens), try increasing it\",\"type\":\"exceed_context_size_error\",\"n_prompt_tokens\":5120,"
             "\"n_ctx\":4096}}")


def ok(lane="agent", ttft=0.3, call=1.0, missed="", prompt=500, out=30, job=None, turn=None):
    """A successful request's record (the fields the diagnosis reads), with a twospeed-like server clock."""
    return {"lane": lane, "error": None, "error_class": None, "status": 200, "ttft_s": ttft, "server_queue_s": 0.01,
            "call_s": call, "ttlt_s": call, "server_ttft_s": ttft, "server_prefill_s": None, "slo_missed": missed,
            "slo_met": not missed, "prompt_tokens": prompt, "cached_tokens": 0, "prefilled_tokens": prompt,
            "output_tokens": out, "finish_reason": "stop", "max_tokens": 64, "needed_tokens": None,
            "itl_s": [0.02] * (out - 1), "server_interfered_steps": 0, "server_decode_steps": out - 1,
            "repeat_share": 0.1, "job": job, "turn": turn, "call_kind": "step" if job is not None else None,
            "observations": [], "clock_source": "twospeed"}


def failed(error=VLLM_400, lane="agent", status=400, job=None, turn=None):
    """A failed request's record as results.record writes it: no timing, every objective missed ("error")."""
    return {**ok(lane, job=job, turn=turn), "error": error, "error_class": errors.classify(error, status),
            "status": status, "ttft_s": None, "call_s": 0.01, "ttlt_s": None, "server_ttft_s": None,
            "slo_missed": "error", "slo_met": False, "output_tokens": 0, "itl_s": [], "clock_source": None}


def run(records, slo=AGENT_SLO, jobs=()):
    lanes = {}
    for r in records:
        lanes.setdefault(r["lane"], {"slo": dict(slo or {}), "gate": {"rate": 0.0}, "prefix": None,
                                     "prefix_tokens": 0, "policy": None})
    for j in jobs:
        lanes[j["lane"]]["jobs"] = {"window": {"window_s": None}}
    return {"run": {"ignore_eos": False, "server_kind": "vllm"}, "lanes": lanes, "requests": list(records),
            "jobs": list(jobs), "server": {"clock": None}}


def one(doc):
    (d,) = diagnose(doc)
    return d


def test_every_request_failed_is_never_fine():
    """The issue's run: 14 of 14 agent requests refused by vLLM for their length."""
    d = one(run([failed() for _ in range(14)]))
    assert d.verdict == ("14 of 14 requests failed (context_length 14); 14 of 14 requests missed (TTFT ≤ 1,500 ms, "
                         "ITL p99 ≤ 150 ms; missed: error 14). User-visible time: no successful request.")
    assert d.problem == "missed" and d.missed == 14 and d.misses_by == {"error": 14} and d.levers == []
    assert "nothing to fix" not in "\n".join(diagnosis_lines([d]))
    assert d.notes[0].startswith("14 context_length: prompt + max_tokens over the server's context")
    assert "maximum context length is 2048 tokens" in d.notes[0]
    assert not any("no server clock" in n or "passed the gate" in n for n in d.notes)  # nothing answered to judge


def test_failures_beside_met_requests_lead_the_verdict():
    d = one(run([ok() for _ in range(8)] + [failed(LLAMA_400), failed("ReadTimeout: timed out", status=0)]))
    assert d.verdict.startswith("2 of 10 requests failed (context_length 1, timeout 1); 2 of 10 requests missed "
                                "(TTFT ≤ 1,500 ms, ITL p99 ≤ 150 ms; missed: error 2). User-visible time: decode ")
    assert d.problem == "missed" and d.split == {} and d.dominant == "decode"  # dominant of the visible time
    assert "nothing to fix" not in d.verdict


def test_failures_and_timed_misses_are_counted_apart():
    slow = [ok(ttft=2.5, call=3.0, missed="ttft_p99") for _ in range(4)]
    d = one(run(slow + [ok() for _ in range(3)] + [failed("HTTP 503: busy", status=503)] * 3))
    assert d.missed == 7 and d.misses_by == {"error": 3, "ttft_p99": 4}
    assert d.verdict.startswith("3 of 10 requests failed (overloaded 3); 7 of 10 requests missed (TTFT ≤ 1,500 ms, "
                                "ITL p99 ≤ 150 ms; missed: error 3, ttft_p99 4); prefill dominates the timed misses (")
    assert d.split["prefill"] > 0.9  # the failures add no time to blame


def test_a_lane_without_an_objective_names_its_failures_first():
    d = one(run([ok() for _ in range(3)] + [failed("HTTP 500: boom", status=500)], slo=None))
    assert d.problem == "all"
    assert d.verdict.startswith("1 of 4 requests failed (server_error 1); no objective set; decode dominates")
    d = one(run([failed("HTTP 500: boom", status=500)], slo=None))
    assert d.verdict == "1 of 1 requests failed (server_error 1); no objective set. User-visible time: no successful request."


def test_a_job_that_ended_on_an_error_is_a_missed_job():
    def job(i, error=None):
        return {"index": i, "lane": "j", "error": error, "queue_s": 0.0, "prefill_s": 0.5, "decode_s": 0.5,
                "tool_s": 0.2, "gate_s": 0.0, "other_s": 0.0, "window_met": True}

    calls = [ok("j", job=0, turn=1), ok("j", job=0, turn=2), ok("j", job=1, turn=1), failed(lane="j", job=1, turn=2)]
    doc = run(calls, jobs=[job(0), job(1, "turn 2 (act): HTTP 400: ...")])
    f = lane_facts(doc, "j")
    assert (f.missed, f.failed_units, f.errors, f.misses_by) == (1, 1, 1, {"error": 1})
    assert f.visible == {"queue": 0.0, "prefill": 0.5, "decode": 0.5, "tool": 0.2, "gate": 0.0}  # the good job only
    d = one(doc)
    assert d.verdict.startswith("1 of 4 calls failed (context_length 1); 1 of 2 jobs missed (TTFT ≤ 1,500 ms, "
                                "ITL p99 ≤ 150 ms; missed: error 1). User-visible time: prefill ")


def test_a_failed_request_is_an_slo_miss_in_the_lane_summary():
    """Judged by results.record from the responses themselves: a refusal misses every objective."""
    workload = load_workload("agent")
    lane = workload.lanes[0]

    def response(i, error=None):
        planned = Planned(i, lane.name, 0.0, "hello", 32, {"prompt_tokens": 5})
        if error is not None:
            return Response(planned, 0.0, 0.0, status=400, error=error, finished=0.01)
        timing = reconstruct([Chunk(0.2, 1), Chunk(0.25, 1)], 0.0, "usage")
        return Response(planned, 0.0, 0.0, timing, '{"tool": "lookup_order", "arguments": {"id": "A1"}}', 200,
                        usage={"prompt_tokens": 5, "completion_tokens": 2}, finished=0.25)

    records = [results.record(response(i), workload, TokenCounter()) for i in range(3)]
    records.append(results.record(response(3, VLLM_400), workload, TokenCounter()))
    assert records[3]["error_class"] == "context_length" and records[3]["slo_missed"] == "error"
    s = results.lane_summary(records, lane.slo, workload.price, 0)
    assert s["errors"] == 1 and s["errors_by_class"] == {"context_length": 1}
    assert s["slo"]["met_requests"] == 3 and s["slo"]["attainment"] == pytest.approx(0.75)


@pytest.mark.parametrize("error,status,cls", [
    (VLLM_400, 400, "context_length"),
    (LLAMA_400, 400, "context_length"),
    ("HTTP 400: {\"error\":{\"message\":\"the prompt has 2100 tokens but max_model_len is 2048\"}}", 400,
     "context_length"),
    ("HTTP 400: {\"error\":{\"message\":\"response_format is not supported\"}}", 400, "bad_request"),
    ("HTTP 401: no key", 401, "auth"), ("HTTP 404: model x not found", 404, "not_found"),
    ("HTTP 429: slow down", 429, "rate_limited"), ("HTTP 503: queue full", 503, "overloaded"),
    ("HTTP 500: boom", 500, "server_error"), ("ReadTimeout: ", 200, "timeout"),
    ("ConnectError: [Errno 111] Connection refused", 0, "connection"),
    ("RemoteProtocolError: peer closed connection", 200, "connection"),
    ("the job's history reached 5000 prompt tokens, over the 4000 the server's context leaves", 0, "job_context"),
    ("the engine failed mid-stream", 200, "stream_error"),
])
def test_error_classes_from_real_bodies(error, status, cls):
    assert errors.classify(error, status) == cls
    assert errors.classify(None, 200) is None
