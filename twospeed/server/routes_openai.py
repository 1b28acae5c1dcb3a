"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE or one body), /v1/models, and
vLLM's /tokenize and /detokenize.

Each handler reads the body and hands it to a worker thread (prepare.py: parse, validate, render,
tokenize, compile), submits the prepared sequences to the engine thread (ServerState.submit), then formats
what comes back: `stream_events` for SSE, `collect` + `final_response` otherwise. The per-endpoint part is
the choice object (text and logprobs for completions; a message or delta, and a tool call, for chat).
Bodies are parsed by hand, so their schemas reach the OpenAPI document through openapi.py (BODY_MODELS).
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import APIRouter, Request

from twospeed.serving.request_group import StreamItem
from twospeed.server.errors import ERROR_RESPONSES
from twospeed.server.openapi import body as body_doc
from twospeed.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                      TokenizeCompletionRequest)
from twospeed.server.responses import (chat_logprobs, completion_echo_logprobs, completion_logprobs, prompt_logprobs_json,
                                       tool_call_json, usage_json)
from twospeed.server.state import ServerState, State
from twospeed.server.streaming import NO_TOKENS, SSEResponse, collect, final_response, stream_events
from twospeed.server.tool_calls import as_generated

router = APIRouter()
BODY_MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
               DetokenizeRequest]  # parsed by hand: openapi.install documents them
ERRORS = {**ERROR_RESPONSES, 413: {"description": "the body is larger than --max-body-bytes",
                                   "content": ERROR_RESPONSES[400]["content"]}}


@router.get("/v1/models", responses=ERRORS)
async def models(state: State):
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "twospeed",
        "root": state.engine.config.model, "max_model_len": state.engine.max_model_len,
        "twospeed": dataclasses.asdict(state.memory)}]}  # compute and checkpoint dtypes, weight and KV formats, pool


# -- completions ----------------------------------------------------------------------------------
@router.post("/v1/completions", responses=ERRORS, openapi_extra=body_doc(CompletionRequest))
async def completions(request: Request, state: State):
    prepared = await state.run(state.prepare.completion, await request.body())
    body, prompts, specs = prepared.body, prepared.prompts, prepared.specs
    group = await state.submit(body, request, specs)
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompt_lens = [len(ids) for _, ids in prompts]
    if body.stream:
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
        echoes = []
        if body.echo:
            for i, (text, ids) in enumerate(prompts):
                echo = text if text is not None else _decode(state, ids)
                echoes += [{**base, "choices": [{"index": i * body.n + j, "text": echo, "logprobs": None,
                                                 "finish_reason": None}], "twospeed": NO_TOKENS}
                           for j in range(body.n)]
        chunks = stream_events(state, group, base, echoes, _CompletionDelta(state, body), _include_usage(body),
                               prompt_lens, body.n)
        return SSEResponse(chunks, state, group)
    finals = await collect(state, group, request)
    choices = []
    for f in finals:
        out = f.output
        text = out.text
        if body.echo:
            prompt_text, ids = prompts[f.index // body.n]
            text = (prompt_text if prompt_text is not None else _decode(state, ids)) + text
        logprobs = None
        if body.logprobs is not None and body.echo:
            logprobs = completion_echo_logprobs(state.token_text, out.prompt_token_ids, out.prompt_logprobs,
                                                out.logprobs or [], body.logprobs)
        elif body.logprobs is not None:
            logprobs = completion_logprobs(state.token_text, out.logprobs or [], 0)
        choice = {"index": f.index, "text": text, "logprobs": logprobs,
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(state.token_text, out.prompt_logprobs)
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        choices.append(choice)
    return final_response(group, finals, {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices, "system_fingerprint": None, "usage": usage_json(finals, prompt_lens, body.n)})


class _CompletionDelta:
    """The streamed choice of one engine delta: new text, its logprobs (offsets running per choice), token ids."""

    def __init__(self, state: ServerState, body: CompletionRequest):
        self.state, self.body = state, body
        self.offsets: dict[int, int] = {}

    def __call__(self, item: StreamItem) -> dict:
        delta, body = item.delta, self.body
        finish = delta.finish
        choice = {"index": item.index, "text": delta.new_text, "logprobs": None,
                  "finish_reason": finish and finish.reason, "stop_reason": finish and finish.stop_reason}
        if body.logprobs is not None and delta.new_logprobs:
            offset = self.offsets.get(item.index, 0)
            choice["logprobs"] = completion_logprobs(self.state.token_text, delta.new_logprobs, offset)
            self.offsets[item.index] = offset + sum(len(t) for t in choice["logprobs"]["tokens"])
        if body.return_token_ids:
            choice["token_ids"] = list(delta.new_token_ids)
        return choice


# -- chat -----------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", responses=ERRORS, openapi_extra=body_doc(ChatCompletionRequest))
async def chat_completions(request: Request, state: State):
    prepared = await state.run(state.prepare.chat, await request.body())
    body, specs = prepared.body, prepared.specs
    ids = prepared.prompts[0][1]
    top_n = _top_logprobs(body)
    group = await state.submit(body, request, specs)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": state.model_name, "system_fingerprint": None}
        roles = []
        for j in range(body.n):
            choice = {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}
            if body.return_token_ids:
                choice["token_ids"] = []
            roles.append({**base, "choices": [choice], "twospeed": NO_TOKENS})
        chunks = stream_events(state, group, base, roles, _ChatDelta(state, body), _include_usage(body),
                               [len(ids)], body.n)
        return SSEResponse(chunks, state, group)
    finals = await collect(state, group, request)
    choices = []
    for f in finals:
        out = f.output
        message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
        call, finish = _tool_call(body, out.text, finish)
        if call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call_json(call)]}
        choice = {"index": f.index, "message": message,
                  "logprobs": (chat_logprobs(state.token_text, out.logprobs or [], top_n)
                               if top_n is not None else None),
                  "finish_reason": finish, "stop_reason": out.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    extra = {}
    if body.prompt_logprobs is not None:  # vLLM's: once per response, the prompt is every choice's
        extra["prompt_logprobs"] = prompt_logprobs_json(state.token_text, finals[0].output.prompt_logprobs)
    return final_response(group, finals, {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices, "system_fingerprint": None, "usage": usage_json(finals, [len(ids)], body.n), **extra})


class _ChatDelta:
    """The streamed choice of one engine delta. With tools, a choice whose text starts with "{" is a tool
    call: its text is held back and sent as one tool_calls delta when the call ends (complete, or cut off by
    max_tokens with its partial arguments and finish_reason "length")."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest):
        self.state, self.body = state, body
        self.top_n = _top_logprobs(body)
        self.held: set[int] = set()
        self.started: set[int] = set()  # choices whose text has begun (a tool call begins with "{")

    def __call__(self, item: StreamItem) -> dict:
        out, body = item.delta, self.body
        end = out.finish
        delta = {"content": out.new_text} if out.new_text or end is None else {}
        finish = end and end.reason
        if body.tool_mode != "none" and (item.index in self.held or self._begins_call(item.index, out.new_text)):
            self.held.add(item.index)
            delta = {}
            if end is not None:
                call, finish = _tool_call(body, end.text, finish)
                delta = {"tool_calls": [tool_call_json(call, 0)]} if call is not None else {"content": end.text}
        choice = {"index": item.index, "delta": delta, "logprobs": None, "finish_reason": finish,
                  "stop_reason": end and end.stop_reason}
        if self.top_n is not None and out.new_logprobs:
            choice["logprobs"] = chat_logprobs(self.state.token_text, out.new_logprobs, self.top_n)
        if body.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return choice

    def _begins_call(self, index: int, new_text: str) -> bool:
        """The choice's text starts with "{" (decided by its first text, whichever delta brings it)."""
        if index in self.started or not new_text:
            return False
        self.started.add(index)
        return new_text[0] == "{"


def _tool_call(body: ChatCompletionRequest, text: str, finish: str | None) -> tuple[dict | None, str | None]:
    """(the tool call in a finished choice's text, its finish_reason): a complete call is "tool_calls"; one cut off
    by max_tokens keeps "length" and comes back with its partial arguments, as OpenAI returns it."""
    if finish == "stop" and (call := body.parse_tool_call(text)) is not None:
        return as_generated(text, call), "tool_calls"
    if finish == "length":
        return body.partial_tool_call(text), finish
    return None, finish


# -- vLLM's tokenizer endpoints -------------------------------------------------------------------
_TOKENIZE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    {"$ref": "#/components/schemas/TokenizeCompletionRequest"},
    {"$ref": "#/components/schemas/TokenizeChatRequest"}]}}}}}


@router.post("/tokenize", responses=ERRORS, openapi_extra=body_doc([TokenizeCompletionRequest, TokenizeChatRequest],
                                                               _TOKENIZE_BODY))
async def tokenize(request: Request, state: State):
    """{"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens", "token_strs"}."""
    return await state.run(state.prepare.tokenize, await request.body())


@router.post("/detokenize", responses=ERRORS, openapi_extra=body_doc(DetokenizeRequest))
async def detokenize(request: Request, state: State):
    """{"tokens"} -> {"prompt"}."""
    return await state.run(state.prepare.detokenize, await request.body())


# -- helpers --------------------------------------------------------------------------------------
def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""
