"""Server behaviour that needs its own process: API keys, the bounded waiting queue (429), SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest
from server_harness import ServerProcess, metric_sum, scrape, sse_events

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

KEY = "sekret-key"


@pytest.fixture(scope="module")
def keyed():
    srv = ServerProcess("--api-key", KEY)
    yield srv
    assert srv.stop() == 0


def test_api_key_required(keyed):
    good = {"Authorization": f"Bearer {KEY}"}
    for path in ("/v1/models", "/metrics", "/health"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(f"{keyed.base}{path}", headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{keyed.base}{path}", headers=good).status_code == 200
    # Authentication comes before parsing: a bad body without a key is still a 401.
    r = httpx.post(f"{keyed.url}/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_openai_client_with_and_without_key(keyed):
    import openai

    ok = openai.OpenAI(base_url=keyed.url, api_key=KEY, max_retries=0)
    r = ok.completions.create(model="demo", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=keyed.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.fixture(scope="module")
def small():
    """One request runs at a time and two may wait; /metrics and /health are public."""
    srv = ServerProcess("--api-key", KEY, "--metrics-public", "--max-num-seqs", "1", "--max-waiting", "2",
                        "--shutdown-grace", "30")
    yield srv
    srv.stop()


def test_metrics_public(small):
    assert httpx.get(f"{small.base}/metrics").status_code == 200
    assert httpx.get(f"{small.base}/health").status_code == 200
    assert httpx.get(f"{small.url}/models").status_code == 401


def test_full_waiting_queue_gets_429_and_admitted_requests_finish(small):
    auth = {"Authorization": f"Bearer {KEY}"}
    long_body = {"model": "demo", "prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True}
    short_body = {"model": "demo", "prompt": "short", "max_tokens": 3}

    async def main():
        async with httpx.AsyncClient(timeout=60, headers=auth) as client:
            async with client.stream("POST", f"{small.url}/completions", json=long_body) as running:
                lines = running.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break  # it runs now and holds the only seat
                waiting = [asyncio.create_task(client.post(f"{small.url}/completions", json=short_body))
                           for _ in range(2)]
                deadline = time.monotonic() + 10
                while metric_sum(scrape(small.base), "twospeed_num_requests_waiting") < 2:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                rejected = await client.post(f"{small.url}/completions", json=short_body)
                too_big = await client.post(f"{small.url}/completions", json={**short_body, "n": 3})
                rest = [line async for line in lines]
            admitted = await asyncio.gather(*waiting)
            return rejected, too_big, rest, admitted

    rejected, too_big, rest, admitted = asyncio.run(main())
    assert rejected.status_code == 429
    assert int(rejected.headers["retry-after"]) >= 1
    assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
    assert too_big.status_code == 400  # can never fit the queue: not worth a retry
    assert sse_events(rest)[-1] == "[DONE]"
    assert [r.status_code for r in admitted] == [200, 200]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in admitted)


def test_sigterm_drains_in_flight_requests_and_exits_0(small):
    auth = {"Authorization": f"Bearer {KEY}"}
    host, port = httpx.URL(small.base).host, httpx.URL(small.base).port
    body = {"model": "demo", "prompt": "drain me", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=auth) as client:
        with client.stream("POST", f"{small.url}/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            # A request the server is reading when SIGTERM comes (its body arrives after): refused with 503. The
            # server's "100 Continue" says it has taken the headers and waits for the body.
            late_body = json.dumps({**body, "stream": False}).encode()
            late = socket.create_connection((host, port), timeout=30)
            late.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(late_body)}\r\n"
                         "Expect: 100-continue\r\n\r\n".encode())
            replies = late.makefile("rb")
            assert replies.readline().split()[1] == b"100" and replies.readline() == b"\r\n"
            small.proc.send_signal(signal.SIGTERM)
            # The listener closes once the server takes the signal: then a new connection is refused.
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection((host, port), timeout=1).close()
                except ConnectionRefusedError:
                    break
                assert time.monotonic() < deadline, "still accepting connections 10 s after SIGTERM"
                time.sleep(0.01)
            late.sendall(late_body)
            status_line = replies.readline()
            late.close()
            assert status_line.split()[1] == b"503", status_line
            events = sse_events([first, *lines])
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(e["twospeed"]["num_tokens"] for e in events[:-1]) == 40
    assert small.proc.wait(30) == 0


def test_sigterm_past_the_grace_period_still_exits_0():
    # 2000 tokens: far more than any machine decodes in the 0.5 s grace, so the answer is always cut off
    srv = ServerProcess("--shutdown-grace", "0.5", "--max-model-len", "2048", "--num-gpu-blocks", "160")
    try:
        body = {"model": "demo", "prompt": "too long to wait for", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{srv.url}/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            received = [first]
            try:
                for line in lines:
                    received.append(line)
            except httpx.TransportError:
                pass  # the server may end the response by closing the connection
        chunks = [e for e in sse_events(received) if e != "[DONE]" and e.get("choices")]
        assert chunks and sum(c["twospeed"]["num_tokens"] for c in chunks) < 2000  # cut off, not finished
        assert all(ch.get("finish_reason") != "length" for c in chunks for ch in c["choices"])
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - start < 15
    finally:
        srv.stop()


def test_preemption_is_billed_and_blamed():
    """A pool too small for the batch: sequences are preempted and recomputed, their greedy tokens are still
    those of LLM.generate, the bill shows the recompute, and a missed SLO names preemption as its cause."""
    from server_harness import ENGINE

    from twospeed import LLM, SamplingParams

    srv = ServerProcess("--num-gpu-blocks", "10", "--max-model-len", "160", "--slo", "tight:ttlt=1us")
    try:
        prompts = [f"request number {i} asks for a long answer about caches" for i in range(4)]
        body = {"model": "demo", "max_tokens": 60, "ignore_eos": True, "temperature": 0, "lane": "tight",
                "return_token_ids": True}

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[client.post(f"{srv.url}/completions", json={**body, "prompt": p})
                                              for p in prompts])

        responses = [r.json() for r in asyncio.run(main())]
        metrics = scrape(srv.base)
    finally:
        assert srv.stop() == 0
    reference = LLM("demo", **{**ENGINE, "num_gpu_blocks": 10, "max_model_len": 160})
    expected = reference.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))
    assert [r["choices"][0]["token_ids"] for r in responses] == [e.token_ids for e in expected]
    preempted = [r["twospeed"] for r in responses if r["twospeed"]["num_preemptions"] > 0]
    assert preempted, "the pool was meant to be too small for four sequences"
    assert all(t["bill"]["recomputed_tokens"] > 0 and t["slo"]["cause"] == "preemption" for t in preempted)
    assert metric_sum(metrics, "twospeed_num_preemptions_total") == sum(t["num_preemptions"] for t in preempted)
    assert metric_sum(metrics, "twospeed_slo_requests_total", cause="preemption") == len(preempted)
