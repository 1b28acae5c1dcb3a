"""Per-token ITL reconstruction from multi-token chunks, and the streaming client against canned SSE streams
(twospeed's per-chunk token counts and emit times, vLLM-style usage per chunk, plain text + tokenizer)."""

import asyncio
import json

import httpx
import pytest

from twospeed.lab.client import Chunk, reconstruct, stream_request
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import Planned
from twospeed.lab.workload import Lane

SEND = 100.0


def test_multi_token_chunks_without_server_times():
    chunks = [Chunk(SEND + 0.1, 1), Chunk(SEND + 0.3, 3), Chunk(SEND + 0.3, 0), Chunk(SEND + 0.35, 1)]
    t = reconstruct(chunks, SEND, "usage")
    assert t.ttft == pytest.approx(0.1) and t.ttlt == pytest.approx(0.35) and t.output_tokens == 5
    assert t.itl == pytest.approx([0.2, 0.0, 0.0, 0.05])  # tokens of one chunk share its arrival: gap 0
    assert t.chunk_gaps == pytest.approx([0.2, 0.05])
    assert t.tpot == pytest.approx(0.25 / 4)  # (ttlt - ttft) / (N - 1)
    assert t.source == "usage"


def test_multi_token_chunks_with_server_emit_times():
    emits = [1000.0, 1000.15, 1000.18, 1000.2, 1000.26]
    chunks = [Chunk(SEND + 0.1, 1, emits[:1]), Chunk(SEND + 0.3, 3, emits[1:4]), Chunk(SEND + 0.36, 1, emits[4:])]
    t = reconstruct(chunks, SEND)
    assert t.itl == pytest.approx([0.15, 0.03, 0.02, 0.06])  # each token at its own server emission time
    assert t.token_times[0] == pytest.approx(0.1) and t.token_times[-1] == pytest.approx(0.36)
    assert t.chunk_gaps == pytest.approx([0.2, 0.06]) and t.source == "twospeed"
    assert reconstruct([], SEND).ttft is None and reconstruct([Chunk(SEND + 1, 1)], SEND).tpot is None


def _sse(events):
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _run(events, lane=None, counter=None, status=200):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["headers"] = request.headers
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "nope"}})
        return httpx.Response(200, text=_sse(events), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            planned = Planned(0, "chat", 0.0, "hello", 8, {})
            return await stream_request(client, "http://test/v1", lane or Lane("chat", "chat"), planned, "m",
                                        counter or TokenCounter(), 0.0, ignore_eos=True)

    return asyncio.run(go()), seen


def test_twospeed_stream():
    ts = {"clock": {"queue_ms": 1.0, "ttft_ms": 20.0}, "bill": {"prompt_tokens": 5, "cached_tokens": 0,
                                                                "prefilled_tokens": 5, "output_tokens": 3}}
    events = [{"choices": [{"index": 0, "text": "a", "finish_reason": None}],
               "twospeed": {"num_tokens": 1, "emit_times": [5.0]}},
              {"choices": [{"index": 0, "text": "bc", "finish_reason": "length"}],
               "twospeed": {"num_tokens": 2, "emit_times": [5.02, 5.03]}},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "twospeed": {**ts, "num_tokens": 0}}]
    resp, seen = _run(events)
    assert resp.error is None and resp.text == "abc" and resp.finish_reason == "length"
    assert resp.timing.output_tokens == 3 and resp.timing.source == "twospeed"
    assert resp.timing.itl == pytest.approx([0.02, 0.01])
    assert resp.server["clock"]["queue_ms"] == 1.0 and resp.usage["completion_tokens"] == 3
    assert seen["body"]["stream"] and seen["body"]["ignore_eos"] and seen["body"]["prompt"] == "hello"
    assert seen["body"]["stream_options"]["include_usage"] and seen["headers"]["x-twospeed-lane"] == "chat"


def test_usage_per_chunk_and_chat_endpoint():
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "ab"}}], "usage": {"completion_tokens": 2}},
              {"choices": [{"index": 0, "delta": {"content": "cde"}}], "usage": {"completion_tokens": 5}}]
    lane = Lane("chat", "chat", endpoint="chat", response_format={"type": "json_object"})
    resp, seen = _run(events, lane=lane)
    assert resp.timing.output_tokens == 5 and resp.timing.source == "usage" and resp.text == "abcde"
    assert seen["body"]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen["body"]["response_format"] == {"type": "json_object"}


def test_tokenizer_counts_and_errors():
    from twospeed.engine.engine import resolve_model_path

    counter = TokenCounter(resolve_model_path("demo"))
    words = ["latency", " throughput", " prefill decode"]
    events = [{"choices": [{"index": 0, "text": w}]} for w in words]
    resp, _ = _run(events, counter=counter)
    assert resp.timing.source == "tokenizer"
    assert resp.timing.output_tokens == counter.count("".join(words))
    plain, _ = _run(events)  # no tokenizer, no counts: one token per chunk
    assert plain.timing.output_tokens == 3 and plain.timing.source == "chunks"
    failed, _ = _run(events, status=400)
    assert failed.error.startswith("HTTP 400") and failed.status == 400
    midway, _ = _run([events[0], {"error": {"message": "engine failed"}}])
    assert midway.error == "engine failed"
