"""Checks of the peers harness that need no peer: ratios, the lab summary, command lines, prompt lengths.
`make test` collects them (pyproject's testpaths); alone:

    .venv/bin/python -m pytest benchmarks/peers/test_peers.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_peers  # noqa: E402
import serve  # noqa: E402


def test_ratios_are_to_the_best_in_the_run_and_one_is_best():
    rows = [{"v": 100.0}, {"v": 50.0}, {}]
    up = run_peers.column(rows, lambda r: r["v"], higher_is_better=True)
    assert [x for _, x in up] == ["1.00", "0.50", "-"]
    down = run_peers.column(rows, lambda r: r["v"], higher_is_better=False)  # latency: best / value
    assert [x for _, x in down] == ["0.50", "1.00", "-"]


def _lane(met, met_requests, ttft99=0.5, itl99=0.05):
    stat = lambda p99: {"n": 3, "p50": p99 / 2, "p90": p99, "p99": p99, "max": p99, "p99_ci": None}  # noqa: E731
    return {"requests": 3, "errors": 0, "stats": {"ttft": stat(ttft99), "itl": stat(itl99)},
            "slo": {"attainment": met_requests / 3, "met": met, "met_requests": met_requests},
            "goodput": {"requests": 0, "tokens": 0}}


def test_lab_summary_goodput_and_all_met():
    results = {"run": {"wall_s": 10.0}, "lanes": {"chat": _lane(True, 3), "rag": _lane(False, 1)},
               "total": {"errors": 0}, "client": {"late_requests": 0, "fell_behind": False}}
    s = run_peers.lab_summary(results)
    assert s["slo_goodput_rps"] == pytest.approx(0.4)
    assert s["all_slos_met"] is False
    assert s["lanes"]["chat"]["ttft_p99_s"] == 0.5
    results["lanes"]["rag"] = _lane(None, 0)  # a lane without an SLO does not fail the rate
    assert run_peers.lab_summary(results)["all_slos_met"] is True
    assert run_peers.lab_summary({"error": "boom"}) == {"error": "boom"}


def test_warm_ttft_uses_cache_hits_else_all_but_the_first():
    reqs = [{"index": i, "error": None, "ttft_s": t, "cached_tokens": c}
            for i, (t, c) in enumerate([(1.0, 0), (0.2, 900), (0.3, 900), (0.9, 0)])]
    results = {"run": {"wall_s": 1.0}, "lanes": {}, "total": {"errors": 0},
               "client": {"late_requests": 0, "fell_behind": False}, "requests": reqs}
    s = run_peers.lab_summary(results)
    assert (s["warm_n"], s["warm_ttft_p50_s"], s["warm_ttft_p99_s"]) == (2, 0.2, 0.3)
    for r in reqs:
        r["cached_tokens"] = None  # a server that reports no cache hits
    s = run_peers.lab_summary(results)
    assert s["warm_basis"] == "all but the first request" and s["warm_n"] == 3 and s["warm_ttft_p99_s"] == 0.9
    assert run_peers.percentile([], 50) is None
    assert run_peers.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0


def test_commands_bind_loopback_and_reject_bad_input(monkeypatch):
    monkeypatch.setattr(Path, "exists", lambda self: True)
    for engine in serve.ENGINES:
        cmd, env = serve.command_for(engine, "bf16", 12345)
        assert "127.0.0.1" in cmd and "12345" in cmd
    cmd, env = serve.command_for("vllm", "fp32", 1)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and cmd[cmd.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError):
        serve.command_for("sglang", "bf16", 1)
    with pytest.raises(ValueError):
        serve.command_for("llama", "fp16", 1)


@pytest.mark.parametrize("amx", [False, True])
def test_llama_server_skips_its_amx_buffer_only_on_amx_cpus(monkeypatch, amx):
    monkeypatch.setattr(serve, "amx_cpu", lambda: amx)
    cmd = serve.llama_command(Path("llama-server"), Path("m.gguf"), "m", 1)
    assert ("--no-repack" in cmd) == amx


@pytest.mark.skipif(not (serve.model_dir("bf16") / "tokenizer.json").is_file(), reason="checkpoint not built")
def test_prompts_have_the_asked_token_count_and_differ_by_salt():
    """Needs the peers' own tokenizer (make_checkpoint.py), trained on the prompt words, so each is one piece and
    a one-token gap can be filled; with the demo tokenizer a word can be two or three tokens and overshoot."""
    from client import PromptMaker

    a = PromptMaker(serve.model_dir("bf16"), "aaaa")
    b = PromptMaker(serve.model_dir("bf16"), "bbbb")
    for n in (64, 512):
        p = a.make(n, 0)
        assert n - 1 <= a.count(p) <= n
    assert a.make(64, 0).split(":")[0] != b.make(64, 0).split(":")[0]


def _sse(*chunks) -> bytes:
    import json

    return b"".join(b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n" for c in chunks)


@pytest.mark.parametrize("first_text", ["", "hi"])
def test_client_counts_token_chunks_even_without_text(first_text):
    import asyncio

    import httpx

    from client import stream_one

    body = {"model": "m", "prompt": "p", "max_tokens": 3}
    stream = _sse({"choices": [{"index": 0, "text": first_text, "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 3}}, "[DONE]")
    async def go(status, content):
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content))
        async with httpx.AsyncClient(transport=transport) as c:
            return await stream_one(c, "http://x", body)

    t = asyncio.run(go(200, stream))
    assert t.output_tokens == 3 and 0 <= t.ttft_s <= t.total_s and t.decode_s >= 0
    held_back = _sse(*[{"choices": [{"index": 0, "text": "", "finish_reason": None}]}] * 3,
                     {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, "[DONE]")
    assert asyncio.run(go(200, held_back)).output_tokens == 3  # every byte token held back: still timed
    with pytest.raises(RuntimeError, match="no token"):  # only a finish chunk: nothing was generated
        asyncio.run(go(200, _sse({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}, "[DONE]")))
    with pytest.raises(RuntimeError, match="429"):
        asyncio.run(go(429, b"busy"))


def test_saturation_stops_the_rate_ladder():
    assert run_peers.saturated({"wall_s": 50.0}, arrival_span_s=32.0, factor=2.0) is False
    assert run_peers.saturated({"wall_s": 70.0}, arrival_span_s=32.0, factor=2.0) is True
    assert run_peers.saturated({"error": "x"}, arrival_span_s=32.0, factor=2.0) is True
