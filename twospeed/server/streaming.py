"""How a request's sequences reach the client: one SSE loop for both endpoints, or one collected body.

Both endpoints stream the same way — opening chunks, one chunk per engine delta carrying the tokens'
emission times, an optional usage chunk with the request's whole clock and bill, then `[DONE]`; an
engine failure, an abort or the end of the shutdown grace becomes an OpenAI-style error event followed by
`[DONE]`, so a client always sees a complete stream. What differs (a completion's text and logprobs, a
chat delta and its tool call) is the `choice` function each endpoint passes in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from twospeed.serving.request_group import RequestGroup, ShutdownError, StreamBacklog, StreamItem
from twospeed.server.errors import APIError, error_body
from twospeed.server.responses import request_twospeed, sequence_twospeed, server_timing, usage_json
from twospeed.server.state import ServerState

NO_TOKENS = {"num_tokens": 0, "emit_times": []}  # chunks that carry no generated token (role, echo, usage)
ABORTED = "the request was aborted (the server is shutting down)"
REPLICA_HEADER = "x-twospeed-replica"


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def chunk_twospeed(state: ServerState, item: StreamItem) -> dict:
    """A streamed chunk's twospeed object: its token count and emission times; the clock and bill at the end."""
    ts = {"num_tokens": len(item.delta.new_token_ids),
          "emit_times": [round(state.to_unix(t), 6) for t in item.delta.token_times]}
    if item.output is not None:
        ts.update(sequence_twospeed(item))
    return ts


async def stream_events(state: ServerState, group: RequestGroup, base: dict, opening: Iterable[dict],
                        choice: Callable[[StreamItem], dict], include_usage: bool, prompt_lens: list[int],
                        n: int) -> AsyncIterator[str]:
    """The SSE body of a streaming response. opening: chunks sent before any token (role, echo);
    choice(item) -> the choice object of one engine delta."""
    for chunk in opening:
        yield sse(chunk)
    finals = []
    while not group.done:
        item = await group.next()
        if item.error is not None or item.delta is None:
            e = _item_error(item)
            yield sse(error_body(e.message, e.type))
            break
        yield sse({**base, "choices": [choice(item)], "twospeed": chunk_twospeed(state, item)})
        if item.output is not None:
            finals.append(item)
    else:
        if include_usage and finals:
            finals.sort(key=lambda f: f.index)
            yield sse({**base, "choices": [], "usage": usage_json(finals, prompt_lens, n),
                       "twospeed": {**NO_TOKENS, **request_twospeed(group.lane, finals)}})
    yield sse("[DONE]")


class _ClientGone(Exception):
    pass


async def _watch_disconnect(request: Request, group: RequestGroup) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.queue.put_nowait(_ClientGone())
            return


async def collect(state: ServerState, group: RequestGroup, request: Request) -> list[StreamItem]:
    """Wait for every sequence of a non-streaming request; a client that leaves aborts them."""
    finals: dict[int, StreamItem] = {}
    watcher = asyncio.create_task(_watch_disconnect(request, group))
    try:
        while not group.done:
            item = await group.queue.get()
            if isinstance(item, _ClientGone):
                raise APIError(499, "client closed the request", "client_closed")
            group.take(item)
            if item.error is not None or item.delta is None:
                raise _item_error(item)
            if item.output is not None:
                finals[item.index] = item
        return [finals[i] for i in sorted(finals)]
    finally:
        watcher.cancel()
        state.release(group)


def _item_error(item: StreamItem) -> APIError:
    """What a client is told when its sequence ended without an output: the engine failed it (500), or it was
    aborted, at shutdown or past the grace (503)."""
    if item.error is None or isinstance(item.error, ShutdownError):
        return APIError(503, str(item.error) if item.error else ABORTED, "service_unavailable")
    if isinstance(item.error, StreamBacklog):
        return APIError(408, str(item.error), "request_timeout")
    return APIError(500, str(item.error), "server_error")


def final_response(group: RequestGroup, finals: list[StreamItem], body: dict) -> JSONResponse:
    """A non-streaming body with the request's twospeed object and its Server-Timing header."""
    body["twospeed"] = request_twospeed(group.lane, finals)
    clocks = [f.output.clock for f in finals]
    return JSONResponse(body, headers={"Server-Timing": server_timing(clocks), **replica_header(group)})


def replica_header(group: RequestGroup) -> dict[str, str]:
    """Behind a router, which replica served the request."""
    return {REPLICA_HEADER: group.replica} if group.replica else {}


class SSEResponse(StreamingResponse):
    """Server-sent events whose sequences are aborted however the response ends (done, client gone, shutdown)."""

    def __init__(self, content, state: ServerState, group: RequestGroup):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **replica_header(group)})
        self._state, self._group = state, group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._state.release(self._group)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
