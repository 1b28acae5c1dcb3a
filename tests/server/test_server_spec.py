"""Speculation through the HTTP API, with the official openai client: completions and chat, streamed and not, give
the same text with and without speculation; the `twospeed` object of every response and the final streamed chunk
carries the acceptance trace, consistent with the tokens (accepted <= proposed; output tokens = 1 + decode steps +
accepted); a request's opt-out and a lane's `speculate=off` keep it off, and say so; /metrics counts it all.

Both servers run in this process (ASGI), the demo model in float32 (a verify row and a plain decode compute a
position alike in fp32)."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest

from server_harness import parse_metrics
from twospeed.config import EngineConfig
from twospeed.server.app import ServerConfig, build_app

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

ENGINE = dict(dtype="float32", num_gpu_blocks=96, block_size=16, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=256)
SPEC = dict(spec_method="ngram", prompt_lookup_min=1, spec_auto_fallback=False)
REPEATS = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta"
CALLS = [  # (endpoint, body) pairs; each runs streamed and not
    ("completions", dict(prompt=REPEATS, max_tokens=24, temperature=0)),
    ("completions", dict(prompt="The quick brown fox", max_tokens=20, temperature=0.8, seed=7)),
    ("chat", dict(messages=[{"role": "user", "content": REPEATS}], max_tokens=24, temperature=0)),
]


async def run_calls(app, calls, lane: str | None = None, **extra) -> tuple[list, str]:
    """Every call non-streamed and streamed: (text, twospeed object, usage) each, and /metrics afterwards."""
    import openai

    out = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t/v1", timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http, max_retries=0)
            body_extra = {**({"lane": lane} if lane else {}), **extra}
            for endpoint, body in calls:
                create = client.completions.create if endpoint == "completions" else client.chat.completions.create
                r = await create(model="demo", **body, extra_body=body_extra)
                text = r.choices[0].text if endpoint == "completions" else r.choices[0].message.content
                out.append(("plain", text, r.model_extra["twospeed"], r.usage.completion_tokens))
                stream = await create(model="demo", **body, stream=True, stream_options={"include_usage": True},
                                      extra_body=body_extra)
                parts, finals, last = [], [], None
                async for chunk in stream:
                    ts = chunk.model_extra.get("twospeed") or {}
                    for c in chunk.choices:
                        parts.append(c.text if endpoint == "completions" else (c.delta.content or ""))
                        if c.finish_reason is not None:
                            finals.append(ts)
                    if not chunk.choices:
                        last = (ts, chunk.usage.completion_tokens)
                out.append(("stream", "".join(parts), last[0], last[1]))
                assert finals and finals[-1]["spec"] == last[0]["spec"]  # the finishing chunk has it too
            metrics = (await http.get("http://t/metrics")).text
    return out, metrics


def serve(spec: bool, slo: list[str] = ()) -> tuple[list, str]:
    app = build_app(EngineConfig.from_kwargs("demo", **ENGINE, **(SPEC if spec else {})), ServerConfig(slo=list(slo)))
    try:
        return asyncio.run(run_calls(app, CALLS))
    finally:
        gc.unfreeze()  # the server froze this test process's heap at startup


@pytest.fixture(scope="module")
def runs():
    return serve(False), serve(True)


def test_streamed_and_not_identical_with_and_without_speculation(runs):
    (plain, _), (spec, _) = runs
    assert [t for _, t, _, _ in plain] == [t for _, t, _, _ in spec]
    for i in range(0, len(spec), 2):  # each call: non-streamed, then streamed
        assert spec[i][1] == spec[i + 1][1] and plain[i][1] == plain[i + 1][1]


def test_the_trace_is_in_every_response_and_consistent(runs):
    (plain, _), (spec, _) = runs
    assert all(ts["spec"] is None for _, _, ts, _ in plain)
    for _, _, ts, completion_tokens in spec:
        trace, bill, clock = ts["spec"], ts["bill"], ts["clock"]
        assert trace["method"] == "ngram"
        assert 0 <= trace["accepted"] <= trace["proposed"] == bill["spec_proposed"]
        assert trace["accepted"] == bill["spec_accepted"] and trace["rejected"] == bill["spec_rejected"]
        assert sum(trace["accepted_per_position"]) == trace["accepted"]
        assert completion_tokens == bill["output_tokens"] == (1 + clock["decode_steps"] + trace["accepted"]
                                                              + bill["forced_tokens"])
        if trace["verify_steps"]:
            assert trace["mean_acceptance_length"] == pytest.approx(1 + trace["accepted"] / trace["verify_steps"],
                                                                    abs=1e-4)
    assert sum(ts["spec"]["accepted"] for _, _, ts, _ in spec) > 0


def test_metrics_count_drafts_by_lane_and_position(runs):
    (_, _), (spec, metrics) = runs
    m = parse_metrics(metrics)
    proposed = sum(ts["spec"]["proposed"] for _, _, ts, _ in spec)
    accepted = sum(ts["spec"]["accepted"] for _, _, ts, _ in spec)
    key = lambda name, **labels: (name, tuple(sorted({"model": "demo", "lane": "default", **labels}.items())))  # noqa: E731
    assert m[key("twospeed_spec_draft_tokens_total")] == proposed
    assert m[key("twospeed_spec_accepted_tokens_total")] == accepted
    per_position = [m[key("twospeed_spec_accepted_tokens_per_position_total", position=str(i))] for i in range(1, 5)]
    assert sum(per_position) == accepted
    assert m[key("twospeed_spec_fallbacks_total", cause="low_gain")] == 0  # at 0 before any fallback


def test_opt_out_and_lane_policy_keep_speculation_off():
    app = build_app(EngineConfig.from_kwargs("demo", **ENGINE, **SPEC), ServerConfig(slo=["quiet:speculate=off"]))

    async def both():
        quiet, metrics = await run_calls(app, CALLS[:1], lane="quiet")
        return quiet, metrics

    try:
        quiet, metrics = asyncio.run(both())
    finally:
        gc.unfreeze()
    for _, _, ts, _ in quiet:
        assert ts["spec"]["proposed"] == 0
        assert ts["spec"]["events"][0]["cause"] == "lane_policy"
    m = parse_metrics(metrics)
    key = ("twospeed_spec_fallbacks_total", (("cause", "lane_policy"), ("lane", "quiet"), ("model", "demo")))
    assert m[key] == 2
    app = build_app(EngineConfig.from_kwargs("demo", **ENGINE, **SPEC), ServerConfig())
    try:
        out, _ = asyncio.run(run_calls(app, CALLS[:1], speculate=False))
    finally:
        gc.unfreeze()
    assert all(ts["spec"]["proposed"] == 0 and ts["spec"]["events"][0]["cause"] == "opted_out" for _, _, ts, _ in out)
