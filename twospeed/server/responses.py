"""The split clock and bill as the API shows them, and OpenAI's usage and logprobs objects.

Pure functions from engine objects (Clock, Bill, Logprob, the async engine's StreamItems) to JSON-ready
dicts; times in milliseconds, rounded to the microsecond. Used by app.py for bodies, streamed chunks and
the Server-Timing header.
"""

from __future__ import annotations

import dataclasses

import json
import math
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from twospeed.engine.request import Logprob
from twospeed.schema.clock import Clock, merged_clock_json
from twospeed.schema.twospeed_object import SequenceFacts, sequence_object, twospeed_object

if TYPE_CHECKING:  # annotations only: the planner's simulator writes clocks without the engine (or torch)
    from twospeed.serving.request_group import StreamItem


# -- the split clock and bill in responses ---------------------------------------------------------
def server_timing(clocks: list[Clock]) -> str:
    m = merged_clock_json(clocks)
    decode = None if m["ttlt_ms"] is None or m["ttft_ms"] is None else round(m["ttlt_ms"] - m["ttft_ms"], 3)
    parts = [(name, value) for name, value in (("queue", m["queue_ms"]), ("route", m["route_ms"]),
                                               ("prefill", m["prefill_ms"]), ("decode", decode)) if value is not None]
    return ", ".join(f"{name};dur={value}" for name, value in parts)


def facts(item: StreamItem) -> SequenceFacts:
    out = item.output
    return SequenceFacts(item.index, out.clock, out.bill, out.num_preemptions, item.verdict, out.spec)


def sequence_twospeed(item: StreamItem) -> dict:
    """One sequence's `twospeed` object (schema/twospeed_object.py writes it)."""
    return sequence_object(facts(item))


def request_twospeed(lane: str, finals: list[StreamItem]) -> dict:
    """The `twospeed` object of a whole response: merged clock, summed bill, and per choice when n > 1."""
    return twospeed_object(lane, [facts(f) for f in finals])


def usage_json(finals: list[StreamItem], prompt_lens: list[int], n: int) -> dict:
    """OpenAI's usage: each prompt counted once (n samples share it); cached_tokens always present."""
    cached = sum(f.output.bill.cached_tokens for f in finals if f.index % n == 0)
    completion = sum(len(f.output.token_ids) for f in finals)
    prompt = sum(prompt_lens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- logprobs -------------------------------------------------------------------------------------
def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI uses -9999 for "impossible"


def completion_logprobs(token_text: Callable[[int], str], lps: list[Logprob], offset: int) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs (always with the sampled token)."""
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = []
    for lp in lps:
        d = {token_text(t): _finite(v) for t, v in lp.top.items()}
        d.setdefault(token_text(lp.token_id), _finite(lp.logprob))
        top.append(d)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def completion_echo_logprobs(token_text: Callable[[int], str], prompt_ids: list[int], prompt: list[Logprob | None],
                             lps: list[Logprob], n: int) -> dict:
    """echo with logprobs, as OpenAI's legacy completions send it: the prompt's tokens, then the output's; the
    first prompt token has no logprob (null), the others their top n (the engine may have scored more)."""
    scored = [dataclasses.replace(lp, top=dict(list(lp.top.items())[:n])) for lp in prompt[1:]]
    body = completion_logprobs(token_text, scored + lps, 0)
    first = token_text(prompt_ids[0])
    body["tokens"].insert(0, first)
    body["token_logprobs"].insert(0, None)
    body["top_logprobs"].insert(0, None)
    body["text_offset"] = [0] + [o + len(first) for o in body["text_offset"]]
    return body


def prompt_logprobs_json(token_text: Callable[[int], str], lps: list[Logprob | None] | None) -> list | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt's own token and the n most likely."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _finite(v), "rank": r, "decoded_token": token_text(t)}
             for r, (t, v) in enumerate(lp.top.items(), start=1)}
        d.setdefault(str(lp.token_id), {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                        "decoded_token": token_text(lp.token_id)})
        out.append(d)
    return out


def chat_logprobs(token_text: Callable[[int], str], lps: list[Logprob], top_n: int) -> dict:
    """OpenAI's chat logprobs: content[i] = {token, logprob, bytes, top_logprobs}."""

    def entry(token_id: int, value: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

    content = []
    for lp in lps:
        tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in tops]})
    return {"content": content}


# -- tool calls ------------------------------------------------------------------------------------
def tool_call_json(call: dict, index: int | None = None) -> dict:
    """One OpenAI tool call from the {"name", "arguments"} object a tool grammar produced (arguments as a
    JSON string, as OpenAI sends them; a cut-off call's arguments are already the text so far); streamed
    deltas carry the call's index too."""
    args = call["arguments"]
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"],
                        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}
    return out if index is None else {"index": index, **out}
