"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE or one body), /v1/models.

Each handler validates, tokenizes and hands the engine thread a group of sequences (ServerState.submit),
then formats what comes back: `stream_events` for SSE, `collect` + `final_response` otherwise. The
per-endpoint part is the choice object (text and logprobs for completions; a message or delta, and a tool
call, for chat).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from twospeed.server.async_engine import SequenceSpec, StreamItem
from twospeed.server.errors import ERROR_RESPONSES, APIError
from twospeed.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedValue
from twospeed.server.responses import chat_logprobs, completion_logprobs, tool_call_json, usage_json
from twospeed.server.state import ServerState, State
from twospeed.server.streaming import NO_TOKENS, SSEResponse, collect, final_response, stream_events

router = APIRouter()


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def models(state: State):
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "twospeed",
        "root": state.engine.config.model, "max_model_len": state.engine.max_model_len}]}


# -- completions ----------------------------------------------------------------------------------
@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, state: State):
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
        choice = {"index": f.index, "text": text,
                  "logprobs": (completion_logprobs(state.token_text, out.logprobs or [], 0)
                               if body.logprobs is not None else None),
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
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
        out, body = item.output, self.body
        k = len(out.new_token_ids)
        choice = {"index": item.index, "text": out.new_text, "logprobs": None, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        if body.logprobs is not None and k:
            offset = self.offsets.get(item.index, 0)
            choice["logprobs"] = completion_logprobs(self.state.token_text, (out.logprobs or [])[-k:], offset)
            self.offsets[item.index] = offset + sum(len(t) for t in choice["logprobs"]["tokens"])
        if body.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return choice


# -- chat -----------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
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
    top_n = _top_logprobs(body)
    specs = [SequenceSpec(f"chatcmpl-{uuid.uuid4().hex}-{j}", ids, _params(body, body.output_limit, top_n, j), j)
             for j in range(body.n)]
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
    return final_response(group, finals, {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
        "choices": choices, "system_fingerprint": None, "usage": usage_json(finals, [len(ids)], body.n)})


class _ChatDelta:
    """The streamed choice of one engine delta. With tools, a choice whose text starts with "{" is a tool
    call: its text is held back and sent as one tool_calls delta when the call is complete (or as content if
    it was cut off by max_tokens)."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest):
        self.state, self.body = state, body
        self.top_n = _top_logprobs(body)
        self.held: set[int] = set()

    def __call__(self, item: StreamItem) -> dict:
        out, body = item.output, self.body
        k = len(out.new_token_ids)
        delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        finish = out.finish_reason
        if body.tool_mode != "none" and (item.index in self.held or out.text[:1] == "{"):
            self.held.add(item.index)
            delta = {}
            if out.finished:
                call = body.parse_tool_call(out.text) if out.finish_reason == "stop" else None
                if call is not None:
                    delta, finish = {"tool_calls": [tool_call_json(call, 0)]}, "tool_calls"
                else:
                    delta = {"content": out.text}
        choice = {"index": item.index, "delta": delta, "logprobs": None, "finish_reason": finish,
                  "stop_reason": out.stop_reason}
        if self.top_n is not None and k:
            choice["logprobs"] = chat_logprobs(self.state.token_text, (out.logprobs or [])[-k:], self.top_n)
        if body.return_token_ids:
            choice["token_ids"] = list(out.new_token_ids)
        return choice


# -- helpers --------------------------------------------------------------------------------------
def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


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
