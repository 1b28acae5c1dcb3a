"""The lab against small fake servers that speak vLLM's and llama-server's formats, replaying bodies recorded
from the real ones (tests/fixtures/peers/<engine>/, benchmarks/peers/record_fixtures.py): the server recognised
and its context read, the workload fitted to it before anything is sent (or refused with --strict-lengths), the
server's refusals reported by class where it states no context, vLLM's /metrics histograms differenced into the
run's server clock, llama.cpp's per-response timings mapped onto the split clock and bill, and the report
saying which figures are the client's and which the server's. Expected numbers are read off the fixture files
by hand (the comments say where)."""

import asyncio
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from twospeed.engine.engine import resolve_model_path
from twospeed.lab import results, scrape
from twospeed.lab.bench import BenchConfig, run_bench
from twospeed.lab.client import stream_request
from twospeed.lab.job_results import call_split
from twospeed.lab.prompts import TokenCounter
from twospeed.lab.report import source_lines
from twospeed.lab.schedule import Planned
from twospeed.lab.server_kind import ANY, GENERIC, probe
from twospeed.lab.server_llamacpp import LLAMA_CPP
from twospeed.lab.server_vllm import VLLM
from twospeed.lab.workload import Lane, load_workload

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "peers"


def fixture(engine: str, name: str) -> str:
    return (FIXTURES / engine / name).read_text()


class FakePeer:
    """A loopback server answering as the recorded peer did: its /v1/models (and /props), /metrics before the run
    and after `finished` requests, each stream replayed as recorded, and the recorded refusal for a request whose
    prompt (counted with `counter`, as the lab counts it) and max_tokens do not fit `enforce` tokens."""

    def __init__(self, engine: str, counter: TokenCounter, enforce: int | None = None, models: dict | None = None,
                 finished: int | None = None):
        self.engine, self.counter, self.enforce = engine, counter, enforce
        self.models = models if models is not None else json.loads(fixture(engine, "models.json"))
        self.finished_after = finished  # /metrics: the recorded "before" until this many answers, then "after"
        self.posts, self.done, self.refused = 0, 0, 0
        self.lock = threading.Lock()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, body: str, ctype: str = "application/json") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/v1/models":
                    self.reply(200, json.dumps(peer.models))
                elif path == "/props" and (FIXTURES / peer.engine / "props.json").is_file():
                    self.reply(200, fixture(peer.engine, "props.json"))
                elif path == "/metrics" and peer.finished_after is not None:
                    done = peer.done >= peer.finished_after
                    self.reply(200, fixture(peer.engine, "metrics_after.txt" if done else "metrics_before.txt"),
                               "text/plain; version=0.0.4")
                else:
                    self.reply(404, json.dumps({"error": {"message": "not found", "code": 404}}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                chat = self.path.endswith("/chat/completions")
                with peer.lock:
                    peer.posts += 1
                if peer.enforce is not None:
                    n = peer.counter.billed("", "chat", body["messages"]) if chat else \
                        peer.counter.billed(body["prompt"], "completions")
                    if n + body.get("max_tokens", 16) > peer.enforce:
                        refusal = json.loads(fixture(peer.engine, "context_error.json"))
                        with peer.lock:
                            peer.refused += 1
                        self.reply(refusal["status"], json.dumps(refusal["body"]))
                        return
                if body.get("stream"):
                    self.reply(200, fixture(peer.engine, "chat_stream.sse" if chat else "completion_stream.sse"),
                               "text/event-stream")
                else:
                    self.reply(200, fixture(peer.engine, "completion.json"))
                with peer.lock:
                    peer.done += 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def counter():
    return TokenCounter(resolve_model_path("demo"))


def bench(url: str, workload: str, out: Path, **kw) -> tuple[dict, str]:
    console = Console(file=io.StringIO(), width=200)
    cfg = BenchConfig(url=url, model=kw.pop("model", "llama100m-bf16"), workload=workload, tokenizer="demo",
                      seed=0, out=str(out), progress=False, salt="peers", **kw)
    doc = run_bench(cfg, console)
    return doc, console.file.getvalue()


# -- llama-server ------------------------------------------------------------------------------------------
def replay(engine: str, stream: str, kind, endpoint: str = "completions"):
    """One streamed request through the lab's client against the recorded stream, read by `kind`."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=fixture(engine, stream), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            planned = Planned(0, "chat", 0.0, "hello", 12, {"prompt_tokens": 5})
            return await stream_request(client, "http://test/v1", Lane("chat", "chat", endpoint=endpoint), planned,
                                        "m", TokenCounter(), 0.0, kind=kind)

    return asyncio.run(go())


def test_llama_timings_become_the_split_clock_and_bill():
    """chat_stream.sse's last event: timings {cache_n 94, prompt_n 1, prompt_ms 2537.441, predicted_n 12,
    predicted_ms 28182.841}, usage {prompt_tokens 95, cached_tokens 94, completion_tokens 12}."""
    resp = replay("llama", "chat_stream.sse", LLAMA_CPP, "chat")
    c = resp.clock
    assert resp.error is None and resp.finish_reason == "length" and resp.timing.output_tokens > 0
    assert (c.source, c.prefill_ms, c.decode_ms, c.cached_tokens, c.computed_tokens, c.output_tokens) == \
        ("llama.cpp timings", 2537.441, 28182.841, 94, 1, 12)
    assert c.queue_ms is None and c.ttft_ms is None  # llama.cpp states no queue and no TTFT of its own
    workload = load_workload("chat")
    r = results.record(resp, workload, TokenCounter())
    assert (r["prompt_tokens"], r["cached_tokens"], r["prefilled_tokens"], r["output_tokens"]) == (95, 94, 1, 12)
    assert r["server_prefill_s"] == pytest.approx(2.537441) and r["server_decode_s"] == pytest.approx(28.182841)
    assert r["clock_source"] == "llama.cpp timings" and r["server_queue_s"] is None
    # queue is what the client waited beyond the server's prefill: here none (the replay is instant)
    late = dict(r, ttft_s=3.0, call_s=31.5)
    assert call_split(late) == pytest.approx({"queue": 3.0 - 2.537441, "prefill": 2.537441, "decode": 28.5})


def test_a_usage_sent_only_at_the_end_is_the_total_not_the_last_chunks():
    """completion_stream.sse: 12 chunks with text, then one with "" and usage.completion_tokens 12."""
    resp = replay("llama", "completion_stream.sse", ANY)  # a client that does not know the server
    assert resp.timing.output_tokens == 12 and resp.usage["completion_tokens"] == 12
    resp = replay("vllm", "completion_stream.sse", VLLM)  # usage on every chunk: counted chunk by chunk
    assert resp.timing.output_tokens == 12 and resp.timing.source == "usage"


def test_llama_server_is_recognised_with_its_slot_context():
    """props.json: default_generation_settings.n_ctx 4096; models.json: owned_by llamacpp, meta.n_ctx 4096."""
    with FakePeer("llama", TokenCounter()) as peer, httpx.Client() as client:
        info = probe(peer.url, client)
        assert info.kind is LLAMA_CPP and info.context_length == 4096
        assert info.context_source == "llama.cpp's /props n_ctx"
        assert probe(peer.url, client, max_model_len=1024).context_length == 1024  # the flag may lower it
        peer.models["data"][0]["meta"]["n_ctx"] = 2048
        assert probe(peer.url, client).context_length == 4096  # /props first: the slot's context
    models = json.loads(fixture("llama", "models.json"))
    assert LLAMA_CPP.context_length(models, {}) == (4096, "llama.cpp's /v1/models meta.n_ctx")


def test_bench_against_llama_reads_its_clock_per_request(counter, tmp_path):
    """Every request replays completion_stream.sse: timings {cache_n 16, prompt_n 1, prompt_ms 2477.768,
    predicted_n 12, predicted_ms 22837.199}."""
    with FakePeer("llama", counter) as peer:
        doc, printed = bench(peer.url, "chat", tmp_path, requests=4, concurrency=2)
    assert doc["run"]["server_kind"] == "llama.cpp" and doc["total"]["errors"] == 0
    assert doc["run"]["fit"]["context_length"] == 4096 and "every request fits as drawn" in printed
    for r in doc["requests"]:
        assert r["clock_source"] == "llama.cpp timings" and r["server_prefill_s"] == pytest.approx(2.477768)
        assert (r["prompt_tokens"], r["cached_tokens"], r["output_tokens"]) == (17, 16, 12)
        # one token a chunk, as llama.cpp streams (12 chunks with text): no 0 ms gap from re-tokenizing a piece
        assert r["token_source"] == "chunks" and len(r["itl_s"]) == 11 and min(r["itl_s"]) > 0
    sources = doc["run"]["clock_sources"]
    assert sources["prefill"] == "server: llama.cpp timings, per request"
    assert sources["decode"] == "server: llama.cpp timings, per request"
    assert sources["queue"] == "derived: client TTFT less the server's prefill, per request"
    assert sources["cached_tokens"] == "server: llama.cpp timings cache_n, per request"
    assert sources["ttft"] == "client: the stream as received"
    lines = source_lines(doc)
    assert lines[0] == "fit: 4,096-token context (llama.cpp's /props n_ctx): every request fits as drawn"
    assert lines[1].startswith("figures: ttft from client: the stream as received; ")
    assert "prefill from server: llama.cpp timings, per request" in lines[1]
    (d,) = doc["diagnosis"]
    assert any(n.startswith("prefill and decode from llama.cpp's timings per request") for n in d["notes"])
    assert not any("no server clock" in n for n in d["notes"])
    results.validate(doc)


# -- vLLM --------------------------------------------------------------------------------------------------
VLLM_FINISHED = 8  # manifest.json: the requests vLLM finished between metrics_before.txt and metrics_after.txt


def test_vllm_metrics_differenced_into_the_runs_server_clock():
    """Read off metrics_before/after.txt (engine 0, llama100m-bf16): the *_count lines go 1 -> 9; the sums
    queue 3.599699994083494e-05 -> 0.0003076030025113141, prefill 0.10279313800037926 -> 35.078452538998135,
    decode 0.06261435799933679 -> 23.558348968000246, TTFT 0.1227877140045166 -> 44.40337800979614; prefix cache
    queries 5 -> 610, hits 0 -> 0 (vLLM's CPU build caches no prefix by default); prompt tokens 5 -> 610,
    generation 4 -> 100. Buckets (after - before): every queue in le=0.3; prefill 1 in 0.5, 2 in 0.8, 4 in 2.5,
    8 in 10.0; TTFT the same bounds."""
    before = scrape.parse(fixture("vllm", "metrics_before.txt"), VLLM.metric_buckets)
    after = scrape.parse(fixture("vllm", "metrics_after.txt"), VLLM.metric_buckets)
    c = VLLM.run_clock(before, after)
    assert c.source == "vLLM /metrics" and c.requests == VLLM_FINISHED == VLLM.finished(before, after)
    q, p, d, t = (c.phases[k] for k in ("queue", "prefill", "decode", "ttft"))
    assert q.count == p.count == d.count == t.count == 8
    assert q.sum_s == pytest.approx(0.0003076030025113141 - 3.599699994083494e-05)
    assert p.sum_s == pytest.approx(35.078452538998135 - 0.10279313800037926)
    assert d.sum_s == pytest.approx(23.558348968000246 - 0.06261435799933679)
    assert t.sum_s == pytest.approx(44.40337800979614 - 0.1227877140045166)
    assert c.mean_ms("queue") == pytest.approx(0.0002716060025704792 / 8 * 1e3)
    assert (q.p50_s, q.p99_s) == (0.3, 0.3)  # the first bucket holds them all: at most 0.3 s, nothing finer
    assert (p.p50_s, p.p90_s, p.p99_s) == (2.5, 10.0, 10.0) and (t.p50_s, t.p99_s) == (2.5, 10.0)
    assert (c.prefix_cache_queries, c.prefix_cache_hits, c.prefix_hit_rate) == (605, 0, 0.0)
    assert (c.prompt_tokens, c.generation_tokens) == (605, 96)
    assert VLLM.run_clock(before, None) is None and VLLM.run_clock(before, before).requests == 0


def test_vllm_is_recognised_and_its_context_read():
    """models.json: owned_by vllm, max_model_len 4096; a server saying neither is generic."""
    with FakePeer("vllm", TokenCounter()) as peer, httpx.Client() as client:
        info = probe(peer.url, client)
        assert info.kind is VLLM and (info.context_length, info.context_source) == \
            (4096, "vLLM's /v1/models max_model_len")
        peer.models = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "someone"}]}
        info = probe(peer.url, client)
        assert info.kind is GENERIC and info.context_length is None and info.context_source == ""
        info = probe(peer.url, client, max_model_len=2048)
        assert (info.context_length, info.context_source) == (2048, "--max-model-len")


def _vllm_models(max_model_len: int) -> dict:
    models = json.loads(fixture("vllm", "models.json"))
    models["data"][0]["max_model_len"] = max_model_len
    return models


def test_bench_reads_vllms_clock_from_metrics(counter, tmp_path):
    """One lane, so the run's /metrics clock is the lane's: its queue share of the server's queue + prefill
    (0.00027 s of 34.98 s) splits each request's TTFT, and the report names vLLM as its source."""
    with FakePeer("vllm", counter, finished=VLLM_FINISHED) as peer:
        doc, printed = bench(peer.url, "chat", tmp_path, requests=VLLM_FINISHED, concurrency=2)
    assert doc["run"]["server_kind"] == "vllm" and doc["total"]["errors"] == 0
    clock = doc["server"]["clock"]
    assert clock["requests"] == 8 and clock["phases"]["prefill"]["sum_s"] == pytest.approx(34.975659401)
    assert doc["lanes"]["chat"]["server_clock"] == clock
    sources = doc["run"]["clock_sources"]
    assert sources["queue"] == sources["prefill"] == sources["decode"] == \
        "server: vLLM /metrics over this run's only lane"
    assert sources["cached_tokens"].startswith("not reported (0); prefix-cache hits: server: vLLM /metrics")
    assert sources["output_tokens"] == "server: usage per chunk"
    (d,) = doc["diagnosis"]
    assert any(n.startswith("queue and prefill from vLLM's /metrics histograms") for n in d["notes"])
    line = next(x for x in source_lines(doc) if x.startswith("server clock"))
    assert line.startswith("server clock (vLLM /metrics, this run's only lane, 8 requests): queue mean 0.034 ms "
                           "(p50 ≤ 300.0, p99 ≤ 300.0), prefill mean 4,372.0 ms (p50 ≤ 2,500.0, p99 ≤ 10,000.0)")
    assert "; client TTFT mean" in line and "prefix cache served 0% of 605 prompt tokens looked up" in line
    results.validate(doc)


def test_mixed_fits_a_2048_token_vllm_before_sending(counter, tmp_path):
    """The issue's run: vLLM stating max_model_len 2048 and refusing (with its recorded 400) any prompt that does
    not fit with its max_tokens. The lab scales the agent and rag lanes first, so nothing is refused."""
    with FakePeer("vllm", counter, enforce=2048, models=_vllm_models(2048)) as peer:
        doc, printed = bench(peer.url, "mixed", tmp_path, requests=12, rate=50.0)
        assert peer.refused == 0 and peer.posts == 12
    assert doc["total"]["errors"] == 0 and doc["total"]["errors_by_class"] == {}
    fit = doc["run"]["fit"]
    assert fit["context_length"] == 2048 and fit["source"] == "vLLM's /v1/models max_model_len"
    assert {k: v["action"] for k, v in fit["lanes"].items()} == {"agent": "scaled", "rag": "scaled", "chat": "fits",
                                                                 "nightly": "fits"}
    assert printed.startswith("fit: 2,048-token context (vLLM's /v1/models max_model_len):\n  lane agent: prompts "
                              "up to 2,400 tokens + up to 96 output (typical 2,250); prompt lengths scaled 0.813x")
    assert all("nothing to fix" not in d["verdict"] or d["missed"] == 0 for d in doc["diagnosis"])


def test_strict_lengths_refuses_before_sending_anything(counter, tmp_path):
    with FakePeer("vllm", counter, enforce=2048, models=_vllm_models(2048)) as peer:
        with pytest.raises(ValueError, match="--strict-lengths: lane agent: prompts up to 2,400 tokens"):
            bench(peer.url, "mixed", tmp_path, requests=12, rate=50.0, strict_lengths=True)
        assert peer.posts == 0


def test_refusals_from_a_server_stating_no_context_are_reported_by_class(counter, tmp_path):
    """The same 2,048-token server, but saying nothing of its context: the lab sends what the workload draws, the
    server refuses the long ones with vLLM's recorded 400, and the run and the diagnosis say so by class; given
    --max-model-len the lab fits the workload and nothing is refused."""
    bare = {"object": "list", "data": [{"id": "llama100m-bf16", "object": "model", "owned_by": "someone"}]}
    with FakePeer("vllm", counter, enforce=2048, models=bare) as peer:
        doc, printed = bench(peer.url, "mixed", tmp_path / "a", requests=12, rate=50.0)
        refused = peer.refused
    assert printed.startswith("fit: the server states no context length")
    by = doc["total"]["errors_by_class"]
    assert refused > 0 and by == {"context_length": refused} and doc["total"]["errors"] == refused
    for d in doc["diagnosis"]:
        failed = doc["lanes"][d["lane"]]["errors"]
        if failed:
            assert d["verdict"].startswith(f"{failed} of {doc['lanes'][d['lane']]['requests']} requests failed "
                                           f"(context_length {failed}); ")
            assert "nothing to fix" not in d["verdict"]
            assert any("maximum context length is 4096 tokens" in n for n in d["notes"])  # the recorded body
    assert f"errors in rag: {doc['lanes']['rag']['errors']} context_length" in source_lines(doc)
    with FakePeer("vllm", counter, enforce=2048, models=bare) as peer:
        doc, _ = bench(peer.url, "mixed", tmp_path / "b", requests=12, rate=50.0, max_model_len=2048)
        assert peer.refused == 0
    assert doc["total"]["errors"] == 0 and doc["run"]["fit"]["source"] == "--max-model-len"
