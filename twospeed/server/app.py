"""The OpenAI-compatible HTTP server: routes, errors, auth, admission, streaming, graceful shutdown.

Inputs: an EngineConfig (the model and engine options) and a ServerConfig (where to listen,
the API key, the lanes' SLOs, the waiting-queue bound). Outputs: /v1/completions,
/v1/chat/completions (SSE streaming or not), /v1/models, /health, /metrics.

Every response carries the split clock and bill: a `twospeed` object in the body (and in the
final streamed chunk of each choice), a Server-Timing header on non-streaming responses, and
in every streamed chunk the number of tokens it holds and when the server emitted each.
Handlers only tokenize and format; the engine runs in AsyncEngine's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache, partial

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from twospeed.config import EngineConfig
from twospeed.server.async_engine import AsyncEngine, RequestGroup, SequenceSpec, StreamItem, monotonic_to_unix
from twospeed.server.metrics import CONTENT_TYPE, ServerMetrics
from twospeed.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedValue
from twospeed.server.responses import (chat_logprobs, completion_logprobs, request_twospeed, sequence_twospeed,
                                       server_timing, tool_call_json, usage_json)
from twospeed.server.slo import LaneSLO, SLOTable, load_slo_file, parse_slo_flag

log = logging.getLogger("twospeed.server")

LANE_HEADER = "x-twospeed-lane"


@dataclass(slots=True)
class ServerConfig:
    """How the server listens and admits."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000  # 0 = any free port (the printed URL says which)
    api_key: str | None = None  # require `Authorization: Bearer KEY` on /v1/*
    metrics_public: bool = False  # with api_key: leave /metrics and /health open
    served_model_name: str | None = None  # the model id clients send; default: "demo" or the folder given
    max_waiting: int = 256  # sequences admitted but not yet scheduled; beyond it new requests get 429
    shutdown_grace: float = 30.0  # seconds in-flight requests may take to finish after SIGTERM
    slo: list[str] = field(default_factory=list)  # LANE:METRIC=DURATION[,...] specs
    slo_file: str | None = None  # YAML: {lanes: {LANE: {METRIC: DURATION}}}

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace}")

    def lanes(self) -> list[LaneSLO]:
        lanes = [parse_slo_flag(s) for s in self.slo]
        if self.slo_file:
            lanes += load_slo_file(self.slo_file)
        return lanes


class APIError(Exception):
    """An error the client gets as an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


_ERROR_SCHEMA = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "object"}}}}}
ERROR_RESPONSES = {code: {"description": desc, "content": _ERROR_SCHEMA} for code, desc in (
    (400, "invalid request"), (401, "missing or wrong API key"), (429, "waiting queue full; see Retry-After"),
    (503, "shutting down or not ready"))}


class ServerState:
    """What the handlers share: the engine wrapper, the tokenizer, metrics, lanes, the draining flag."""

    def __init__(self, engine, server_config: ServerConfig, model_name: str):
        """engine: an LLMEngine, or a builder that start() runs in the engine thread (AsyncEngine says why)."""
        self.engine = None  # LLMEngine once started, used read-only outside the engine thread (config, tokenizer)
        self.tokenizer = None
        self.config = server_config
        self.model_name = model_name
        self.slos = SLOTable(server_config.lanes())
        self.metrics = ServerMetrics(model_name)
        self.async_engine = AsyncEngine(engine, on_step=self.metrics.on_step, on_finish=self._on_finish,
                                        on_load=self.metrics.set_load)
        self.to_unix = monotonic_to_unix()
        self.draining = False
        self.created = int(time.time())
        self._decode_one = lru_cache(maxsize=65536)(self._decode_token)

    async def start(self) -> None:
        self.async_engine.start()
        self.engine = await self.async_engine.ready()
        self.tokenizer = self.engine.tokenizer

    def _on_finish(self, lane, request, aborted):
        verdict = None if aborted else self.slos.judge(lane, request.clock, request.bill, request.num_preemptions)
        self.metrics.on_finished(lane, request.clock, request.bill, request.num_preemptions, aborted, verdict)
        return verdict

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling when there is no tokenizer
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._decode_one(token_id)


# -- the app --------------------------------------------------------------------------------------
def build_app(engine_config: EngineConfig, server_config: ServerConfig, engine=None) -> FastAPI:
    """The FastAPI app. The engine is loaded in the lifespan (so /health is 200 only once it is), unless given."""
    server_config.lanes()  # fail at start on a bad --slo, not on the first request
    holder: dict[str, ServerState] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        from twospeed.engine.engine import LLMEngine
        source = engine if engine is not None else partial(LLMEngine, engine_config)
        state = ServerState(source, server_config, server_config.served_model_name or engine_config.model)
        await state.start()
        holder["state"] = app.state.twospeed = state
        try:
            yield
        finally:
            state.draining = True
            await state.async_engine.shutdown()

    app = FastAPI(title="twospeed", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server that reports prefill and decode apart.")

    def st() -> ServerState:
        state = holder.get("state")
        if state is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return state

    app.add_middleware(GuardMiddleware, get_state=lambda: holder.get("state"), config=server_config)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(UnsupportedValue)
    async def _unsupported(request: Request, e: UnsupportedValue):
        return error_response(APIError(400, str(e), param=e.param))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        message = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(APIError(e.status_code, message, type_, headers=getattr(e, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.get("/health", responses=ERROR_RESPONSES)
    async def health():
        state = holder.get("state")
        if state is None or state.draining or not state.async_engine.is_alive:
            raise APIError(503, "not ready" if state is None or not state.draining else "shutting down",
                           "service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics", responses=ERROR_RESPONSES)
    async def metrics():
        return Response(st().metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        state = st()
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "twospeed",
            "root": engine_config.model, "max_model_len": state.engine.max_model_len}]}

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        state = st()
        _check_common(state, body)
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append((p, _encode(state, p, True)))
            else:
                prompts.append((None, list(p)))
        specs = []
        for i, (_, ids) in enumerate(prompts):
            for j in range(body.n):
                specs.append(SequenceSpec(f"cmpl-{uuid.uuid4().hex}-{i}-{j}", ids,
                                          _params(body, body.max_tokens, body.logprobs, j), i * body.n + j))
        group = await _submit(state, body, request, specs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return SSEResponse(_stream_completion(state, body, group, rid, prompts), state, group)
        finals = await _collect(state, group, request)
        choices = []
        for f in finals:
            out = f.output
            text = out.text
            if body.echo:
                prompt_text, ids = prompts[f.index // body.n]
                text = (prompt_text if prompt_text is not None else _decode(state, ids)) + text
            choice = {"index": f.index, "text": text,
                      "logprobs": (completion_logprobs(state.token_text, out.logprobs or [], 0)
                                   if body.logprobs is not None else None),
                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = out.prompt_token_ids
            choices.append(choice)
        return _final_response(state, group, finals, {
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "system_fingerprint": None,
            "usage": usage_json(finals, [len(ids) for _, ids in prompts], body.n)})

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state = st()
        _check_common(state, body)
        if state.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer (the server was started with skip_tokenizer_init)")
        messages = [m.to_template() for m in body.messages]
        try:
            text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                       tools=body.tools or None, **(body.chat_template_kwargs or {}))
        except UnsupportedValue:
            raise
        except Exception as e:  # a template's raise_exception, a missing field, no template at all
            raise APIError(400, f"cannot render the chat template: {e}", param="messages") from e
        ids = _encode(state, text, False)  # the template carries its own special tokens, as HF
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        specs = [SequenceSpec(f"chatcmpl-{uuid.uuid4().hex}-{j}", ids, _params(body, body.output_limit, top_n, j), j)
                 for j in range(body.n)]
        group = await _submit(state, body, request, specs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return SSEResponse(_stream_chat(state, body, group, rid, len(ids)), state, group)
        finals = await _collect(state, group, request)
        choices = []
        for f in finals:
            out = f.output
            message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
            call = body.parse_tool_call(out.text) if out.finish_reason == "stop" else None
            if call is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [tool_call_json(call)]}
                finish = "tool_calls"
            choice = {"index": f.index, "message": message,
                      "logprobs": (chat_logprobs(state.token_text, out.logprobs or [], top_n)
                                   if top_n is not None else None),
                      "finish_reason": finish, "stop_reason": out.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        return _final_response(state, group, finals, {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "system_fingerprint": None, "usage": usage_json(finals, [len(ids)], body.n)})

    return app


# -- handler helpers ------------------------------------------------------------------------------
_UNION_TAG = re.compile(r"[\[\]-]|^(str|int|float|bool|list|dict|none|json-or-python)$")


def validation_error(e: RequestValidationError) -> APIError:
    """pydantic's errors as one OpenAI-style message; param is the field's path (messages.0.role)."""
    errors = e.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})".replace(" ()", ""))

    def path(err: dict) -> str:
        # Drop "body" and the tags pydantic adds for union members ("str", "list[str]", ...).
        return ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_TAG.search(str(p)))

    param = path(first)
    if not param:
        if first.get("type") == "missing":
            return APIError(400, "the request body is missing (expected a JSON object)")
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}")
    same = list(dict.fromkeys(err.get("msg", "") for err in errors if path(err) == param))
    message = f"{param}: {' or '.join(same[:4])}"
    others = len({path(err) for err in errors} - {param})
    if others:
        message += f" (and {others} more invalid field{'s' if others > 1 else ''})"
    return APIError(400, message, param=param)


def _check_common(state: ServerState, body) -> None:
    if body.model is not None and body.model not in (state.model_name, state.engine.config.model):
        raise APIError(400, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")
    try:
        body.check_supported()
    except UnsupportedValue as e:
        raise APIError(400, str(e), param=e.param) from None


def _params(body, max_tokens, logprobs, j):
    try:
        return body.sampling_params(max_tokens, logprobs, j)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    if state.tokenizer is None:
        raise APIError(400, "text prompts need a tokenizer (the server was started with skip_tokenizer_init); "
                            "send token ids", param="prompt")
    return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


async def _submit(state: ServerState, body, request: Request, specs: list[SequenceSpec]) -> RequestGroup:
    """Admission (lane, queue bound) and the engine's own validation; returns the running group."""
    lane_name = body.lane if body.lane is not None else request.headers.get(LANE_HEADER)
    try:
        lane = state.slos.admit(lane_name)
    except ValueError as e:
        raise APIError(400, str(e), param="lane") from None
    engine = state.async_engine
    if state.draining:
        raise APIError(503, "the server is shutting down", "service_unavailable")
    limit = state.config.max_waiting
    if len(specs) > limit:
        raise APIError(400, f"this request asks for {len(specs)} sequences (prompts x n) but at most {limit} may "
                            f"wait (--max-waiting)", param="n")
    if engine.num_waiting + len(specs) > limit:
        # A rough wait: the excess over the bound, drained a running batch at a time, at least a second.
        seats = state.engine.scheduler_config.max_num_seqs
        retry = max(1, math.ceil((engine.num_waiting + len(specs) - limit) / seats))
        raise APIError(429, f"the server is at capacity: {engine.num_waiting} sequences waiting "
                            f"(--max-waiting {limit}); retry later", "rate_limit_exceeded",
                       code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
    priority = body.priority if body.priority is not None else (lane.priority or 0)
    group = RequestGroup(lane.lane, priority, time.monotonic(), specs)
    try:
        await engine.add(group)
    except ValueError as e:
        message = str(e)
        structured = "structured output" in message or "JSON schema" in message or "grammar" in message
        param = body.structured_param if structured else ("prompt" if "prompt" in message else None)
        raise APIError(400, message, param=param) from None
    except RuntimeError as e:
        raise APIError(400, f"the engine refused this request: {e}") from None
    return group


class _ClientGone(Exception):
    pass


async def _watch_disconnect(request: Request, group: RequestGroup) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            group.queue.put_nowait(_ClientGone())
            return


async def _collect(state: ServerState, group: RequestGroup, request: Request) -> list[StreamItem]:
    """Wait for every sequence of a non-streaming request; a client that leaves aborts them."""
    finals: dict[int, StreamItem] = {}
    watcher = asyncio.create_task(_watch_disconnect(request, group))
    try:
        while not group.done:
            item = await group.queue.get()
            if isinstance(item, _ClientGone):
                raise APIError(499, "client closed the request", "client_closed")
            if item.finished:
                group.unfinished.discard(item.request_id)
            if item.error is not None:
                raise APIError(500, str(item.error), "server_error")
            if item.output is None:
                raise APIError(503, "the request was aborted (the server is shutting down)", "service_unavailable")
            if item.finished:
                finals[item.index] = item
        return [finals[i] for i in sorted(finals)]
    finally:
        watcher.cancel()
        state.async_engine.abort(group)


def _final_response(state: ServerState, group: RequestGroup, finals: list[StreamItem], body: dict) -> JSONResponse:
    body["twospeed"] = request_twospeed(group.lane, finals)
    clocks = [f.output.clock for f in finals]
    return JSONResponse(body, headers={"Server-Timing": server_timing(clocks)})


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


_NO_TOKENS = {"num_tokens": 0, "emit_times": []}  # chunks that carry no generated token (role, echo, usage)


def _chunk_twospeed(state: ServerState, item: StreamItem) -> dict:
    ts = {"num_tokens": len(item.output.new_token_ids),
          "emit_times": [round(state.to_unix(t), 6) for t in item.token_times]}
    if item.output.finished:
        ts.update(sequence_twospeed(item))
    return ts


async def _stream_items(state: ServerState, group: RequestGroup) -> AsyncIterator[StreamItem | dict]:
    """The group's items; an error dict (OpenAI-style) if the engine failed or aborted the request."""
    while not group.done:
        item = await group.next()
        if item.error is not None or item.output is None:
            message = str(item.error) if item.error else "the request was aborted (the server is shutting down)"
            yield error_body(message, "server_error")
            return
        yield item


async def _stream_completion(state: ServerState, body: CompletionRequest, group: RequestGroup, rid: str,
                             prompts: list) -> AsyncIterator[str]:
    created, finals, offsets = int(time.time()), [], {}
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    if body.echo:
        for i, (text, ids) in enumerate(prompts):
            for j in range(body.n):
                echo = text if text is not None else _decode(state, ids)
                yield _sse({**base, "choices": [{"index": i * body.n + j, "text": echo, "logprobs": None,
                                                 "finish_reason": None}], "twospeed": _NO_TOKENS})
    async for item in _stream_items(state, group):
        if isinstance(item, dict):
            yield _sse(item)
            break
        out = item.output
        k = len(out.new_token_ids)
        choice = {"index": item.index, "text": out.new_text, "logprobs": None, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        if body.logprobs is not None and k:
            lps = (out.logprobs or [])[-k:]
            choice["logprobs"] = completion_logprobs(state.token_text, lps, offsets.get(item.index, 0))
            offsets[item.index] = offsets.get(item.index, 0) + sum(len(t) for t in choice["logprobs"]["tokens"])
        if body.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        yield _sse({**base, "choices": [choice], "twospeed": _chunk_twospeed(state, item)})
        if out.finished:
            finals.append(item)
    else:
        if body.stream_options and body.stream_options.include_usage and finals:
            yield _usage_chunk(base, group, finals, [len(ids) for _, ids in prompts], body.n)
    yield _sse("[DONE]")


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, group: RequestGroup, rid: str,
                       prompt_len: int) -> AsyncIterator[str]:
    created, finals = int(time.time()), []
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
            "system_fingerprint": None}
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    for j in range(body.n):
        choice = {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        if body.return_token_ids:
            choice["token_ids"] = []
        yield _sse({**base, "choices": [choice], "twospeed": _NO_TOKENS})
    # With tools, a choice whose text starts with "{" is a tool call: its text is held back and sent as one
    # tool_calls delta when the call is complete (or as content if it was cut off by max_tokens).
    held: dict[int, str] = {}
    async for item in _stream_items(state, group):
        if isinstance(item, dict):
            yield _sse(item)
            break
        out = item.output
        k = len(out.new_token_ids)
        delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        finish = out.finish_reason
        if body.tool_mode != "none" and (item.index in held or out.text[:1] == "{"):
            held[item.index] = out.text
            delta = {}
            if out.finished:
                call = body.parse_tool_call(out.text) if out.finish_reason == "stop" else None
                if call is not None:
                    delta, finish = {"tool_calls": [tool_call_json(call, 0)]}, "tool_calls"
                else:
                    delta = {"content": out.text}
        choice = {"index": item.index, "delta": delta,
                  "logprobs": None, "finish_reason": finish, "stop_reason": out.stop_reason}
        if top_n is not None and k:
            choice["logprobs"] = chat_logprobs(state.token_text, (out.logprobs or [])[-k:], top_n)
        if body.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        yield _sse({**base, "choices": [choice], "twospeed": _chunk_twospeed(state, item)})
        if out.finished:
            finals.append(item)
    else:
        if body.stream_options and body.stream_options.include_usage and finals:
            yield _usage_chunk(base, group, finals, [prompt_len], body.n)
    yield _sse("[DONE]")


def _usage_chunk(base: dict, group: RequestGroup, finals: list, prompt_lens: list[int], n: int) -> str:
    """The last data chunk of a stream with include_usage: usage plus the request's whole clock and bill."""
    finals.sort(key=lambda f: f.index)
    return _sse({**base, "choices": [], "usage": usage_json(finals, prompt_lens, n),
                 "twospeed": {**_NO_TOKENS, **request_twospeed(group.lane, finals)}})


class SSEResponse(StreamingResponse):
    """Server-sent events whose sequences are aborted however the response ends (done, client gone, shutdown)."""

    def __init__(self, content, state: ServerState, group: RequestGroup):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._state, self._group = state, group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._state.async_engine.abort(self._group)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


class GuardMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): API key, and no new work while draining."""

    def __init__(self, app, get_state, config: ServerConfig):
        self.app = app
        self.get_state = get_state
        self.config = config
        self._key = config.api_key.encode() if config.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self._key is not None and self._needs_key(path):
            scheme, _, token = dict(scope.get("headers") or ()).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                response = JSONResponse(error_body("missing or incorrect API key (send Authorization: Bearer KEY)",
                                                   "authentication_error", None, "invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        state = self.get_state()
        if state is not None and state.draining and path.startswith("/v1/") and scope.get("method") == "POST":
            response = JSONResponse(error_body("the server is shutting down", "service_unavailable"), status_code=503,
                                    headers={"Connection": "close"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _needs_key(self, path: str) -> bool:
        if path.startswith("/v1/") or path == "/v1":
            return True
        return path in ("/metrics", "/health") and not self.config.metrics_public


# -- running it -----------------------------------------------------------------------------------
def run_server(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    """Serve until SIGTERM/SIGINT: then stop admitting, let in-flight requests finish (up to
    shutdown_grace seconds), abort the rest, and return 0."""
    app = build_app(engine_config, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_level=log_level,
                            timeout_graceful_shutdown=server_config.shutdown_grace, lifespan="on",
                            access_log=log_level == "debug")
    server = _Server(config, app)
    server.run()
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling: the first SIGTERM/SIGINT drains, a second one forces the exit.
    (uvicorn re-raises a caught signal after shutting down, which would make the exit status 143, not 0.)"""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self._app = app

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        state = getattr(self._app.state, "twospeed", None)
        if state is not None:
            state.draining = True
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            state = self._app.state.twospeed
            print(f"twospeed: serving {state.model_name!r} at http://{host}:{port}/v1 "
                  f"({state.engine.num_blocks} KV blocks, max_model_len {state.engine.max_model_len})", flush=True)
