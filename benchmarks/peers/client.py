"""A small streaming client for /v1/completions that times each request the same way on every engine.

One request: POST with stream=true, greedy, EOS ignored, a fixed max_tokens. TTFT is from just before the
request is sent to the first streamed chunk that carries a token (text, or an unfinished choice whose text is
held back as incomplete UTF-8); decode rate is (output tokens - 1) / (last token chunk - first token chunk). Output tokens come from the final usage chunk (stream_options.include_usage)
where the engine sends one, else from max_tokens (EOS is ignored, so every request runs to it).
Prompts are text: each engine tokenizes them itself, as a user's request would have it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from twospeed.lab.client import sse_events

WORDS = ("account order invoice shipment refund customer warehouse carrier delay status region policy update "
         "report ticket priority escalate review approve reject balance payment credit window schedule route "
         "inventory supplier contract clause renewal discount margin forecast quarter budget audit compliance "
         "incident outage latency deploy rollback service cluster replica backup restore metric alert").split()


@dataclass(slots=True)
class Timing:
    """One streamed request, as the client saw it."""

    ttft_s: float
    total_s: float
    output_tokens: int
    decode_s: float  # first token chunk to last token chunk

    @property
    def decode_tok_s(self) -> float:
        return (self.output_tokens - 1) / self.decode_s if self.decode_s > 0 and self.output_tokens > 1 else 0.0


class PromptMaker:
    """Text prompts of an exact token count in the checkpoint's tokenizer (BOS included), each starting
    with the run's salt so no prefix cached by an earlier run, or engine, can be hit."""

    def __init__(self, tokenizer_dir: Path, salt: str, seed: int = 0):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.salt = salt
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def make(self, tokens: int, index: int) -> str:
        """A prompt of exactly `tokens` tokens (BOS included), or one fewer where no word fits the gap."""
        words = [f"run {self.salt} request {index}:"]
        while self.count(" ".join(words)) < tokens:
            words.append(self.rng.choice(WORDS))
        while len(words) > 1 and self.count(" ".join(words)) > tokens:
            words.pop()
        return " ".join(words)


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    """Greedy, EOS ignored (vLLM's and llama.cpp's name for it; twospeed takes the same)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> Timing:
    """Send one streaming completion and time it."""
    t0 = time.perf_counter()
    first = last = None
    usage_tokens = None
    tail: list[dict] = []  # the last events, for the error message of a stream without tokens
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {text}")
        async for chunk in sse_events(resp):
            now = time.perf_counter()
            tail = (tail + [chunk])[-3:]
            # a token event: text, or a choice still running with no text yet (vLLM streams one chunk a token,
            # with text "" while the bytes so far are not valid UTF-8: a random model's byte tokens do that)
            if any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or []):
                first = first if first is not None else now
                last = now
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token; last events: {str(tail)[:600]}")
    return Timing(ttft_s=first - t0, total_s=end - t0, output_tokens=usage_tokens or body["max_tokens"],
                  decode_s=last - first)


async def run_concurrent(url: str, bodies: list[dict], concurrency: int,
                         errors: list[str] | None = None) -> tuple[list[Timing], float]:
    """Closed loop: `concurrency` requests in flight until `bodies` are done. Returns timings and wall time.
    With `errors`, a failed request is appended there (and left out of the timings) instead of raising."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one(body: dict) -> Timing:
            async with sem:
                return await stream_one(client, url, body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies), return_exceptions=errors is not None)
        wall = time.perf_counter() - t0
        for r in results:
            if isinstance(r, BaseException):
                errors.append(f"{type(r).__name__}: {r}")
        return [r for r in results if isinstance(r, Timing)], wall
