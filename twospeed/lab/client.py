"""Token-accurate client timing over a streamed (SSE) OpenAI-compatible response.

TTFT is send -> the first chunk that carries content. Each chunk's token count comes from the best source
the server gives: twospeed's per-chunk `twospeed.num_tokens` and `emit_times` (the server's own emission
time of every token), else `usage.completion_tokens` per chunk (vLLM's continuous_usage_stats; a usage only
the last event carries is the answer's total, not that chunk's), else one token a chunk where the server's kind
streams so (llama.cpp), else the tokenizer on the text, else one token per chunk. Per-token ITL: gaps between
consecutive token times, where tokens that arrived in one chunk share its time (gap 0) unless the server stamped
each; per-chunk gaps are kept beside them. TPOT = (TTLT - TTFT) / (N - 1).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import Planned
from twospeed.lab.server_kind import ANY, RequestClock, ServerKind
from twospeed.lab.workload import Lane

LANE_HEADER = "x-twospeed-lane"


@dataclass(slots=True)
class Chunk:
    recv: float  # client time (s, perf_counter) the chunk was read
    num_tokens: int  # output tokens in it
    emit_times: list[float] = field(default_factory=list)  # server emission time of each token (Unix s), if given


@dataclass(slots=True)
class Timing:
    """What the client saw, in seconds relative to its send time."""

    ttft: float | None
    ttlt: float | None
    tpot: float | None
    itl: list[float]  # per token
    chunk_gaps: list[float]  # per chunk that carried tokens
    token_times: list[float]  # each output token's time since send
    output_tokens: int
    source: str  # where token counts came from: twospeed | usage | tokenizer | chunks


def reconstruct(chunks: list[Chunk], send: float, source: str = "chunks") -> Timing:
    """Per-token times from chunks: server emit times when every token has one (shifted so the first token
    lands on the client's first-token time), else each token at its chunk's arrival."""
    chunks = [c for c in chunks if c.num_tokens > 0]
    if not chunks:
        return Timing(None, None, None, [], [], [], 0, source)
    first = chunks[0].recv - send
    stamped = all(len(c.emit_times) == c.num_tokens for c in chunks)
    if stamped:
        emits = [t for c in chunks for t in c.emit_times]
        times = [first + (t - emits[0]) for t in emits]
    else:
        times = [c.recv - send for c in chunks for _ in range(c.num_tokens)]
    itl = [b - a for a, b in zip(times, times[1:])]
    recv = [c.recv for c in chunks]
    chunk_gaps = [b - a for a, b in zip(recv, recv[1:])]
    n = len(times)
    ttlt = chunks[-1].recv - send
    tpot = (ttlt - first) / (n - 1) if n > 1 else None
    return Timing(first, ttlt, tpot, itl, chunk_gaps, times, n, "twospeed" if stamped else source)


@dataclass(slots=True)
class Response:
    """One request as sent and received: timing, text, and what the server said about itself."""

    planned: Planned
    intended: float | None  # s from run start
    sent: float  # s from run start
    timing: Timing | None = None
    text: str = ""
    status: int = 0
    error: str | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    server: dict | None = None  # the request's `twospeed` object (clock, bill, slo) when the server is twospeed
    finished: float | None = None  # s from run start: the stream was read to its end
    gate: object = None  # a job call's gate verdict (gates.GateResult), judged by the job runner
    peer: dict = field(default_factory=dict)  # a peer's per-response objects (llama.cpp's `timings`), by key
    clock: RequestClock | None = None  # the request's clock and bill as its server reported them


def request_body(lane: Lane, planned: Planned, model: str, ignore_eos: bool) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": planned.max_tokens, "temperature": lane.temperature,
                  "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    # A job's calls carry their step's own response_format (a summary or an unconstrained step has none)
    response_format = lane.response_format if planned.turn is None else planned.response_format
    if response_format is not None:
        body["response_format"] = response_format
    if lane.endpoint == "chat":
        messages = planned.messages or [{"role": "user", "content": planned.prompt}]
        return "/chat/completions", {**body, "messages": messages}
    return "/completions", {**body, "prompt": planned.prompt}


def _content(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of an OpenAI-style server-sent-event stream, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def stream_request(client: httpx.AsyncClient, base_url: str, lane: Lane, planned: Planned, model: str,
                         counter: TokenCounter, run_start: float, ignore_eos: bool = False,
                         kind: ServerKind = ANY) -> Response:
    """Send one streamed request and time every chunk; errors are recorded, never raised. `kind` (the server's
    format, server_kind.py) keeps its per-response objects and reads the request's server clock from them."""
    path, body = request_body(lane, planned, model, ignore_eos)
    chunks: list[Chunk] = []
    texts: list[str] = []
    source, last_usage_tokens = "chunks", 0
    per_chunk_usage = True  # every text chunk so far carried usage (vLLM's continuous_usage_stats)
    send = time.perf_counter()
    resp = Response(planned, planned.offset, send - run_start)
    try:
        async with client.stream("POST", base_url + path, json=body, headers={LANE_HEADER: lane.name}) as r:
            resp.status = r.status_code
            if r.status_code != 200:
                resp.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                resp.finished = time.perf_counter() - run_start
                return resp
            async for event in sse_events(r):
                now = time.perf_counter()
                if "error" in event:
                    err = event["error"]
                    resp.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    break
                kind.observe(event, resp)
                ts = event.get("twospeed") or {}
                if event.get("usage"):
                    resp.usage = event["usage"]
                if ts.get("clock") and not event.get("choices"):
                    resp.server = ts  # the include_usage chunk: the request's whole clock and bill
                for choice in event.get("choices") or []:
                    text = _content(choice)
                    resp.finish_reason = choice.get("finish_reason") or resp.finish_reason
                    if text and not event.get("usage"):
                        per_chunk_usage = False  # a text chunk without usage: the server sends usage last, whole
                    if "num_tokens" in ts:
                        k, emits, source = ts["num_tokens"], ts.get("emit_times") or [], "twospeed"
                    elif per_chunk_usage and event.get("usage") and "completion_tokens" in event["usage"]:
                        total = event["usage"]["completion_tokens"]
                        k, emits, source, last_usage_tokens = total - last_usage_tokens, [], "usage", total
                    elif kind.one_token_per_chunk:
                        k, emits, source = (1 if text else 0), [], "chunks"
                    elif text and counter.exact:
                        before = counter.count("".join(texts))
                        k, emits, source = counter.count("".join(texts) + text) - before, [], "tokenizer"
                    else:
                        k, emits = (1 if text else 0), []
                    texts.append(text)
                    if k > 0 or text:
                        chunks.append(Chunk(now, max(k, 1 if text else 0), emits))
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, OSError) as e:  # a foreign server's garbage
        resp.error = f"{type(e).__name__}: {e}"
    resp.text = "".join(texts)
    resp.timing = reconstruct(chunks, send, source)
    resp.clock = kind.request_clock(resp)
    resp.finished = time.perf_counter() - run_start
    return resp
