"""Request preparation, in a worker thread: raw body -> validated request -> prompt token ids -> sequences.

Everything a request needs before the engine sees it that can take long on a large or hostile body runs
here, never on the event loop: parsing and validating the JSON (body.py), OpenAI's conversation rules,
checking schemas (once per distinct schema), rendering the chat template, tokenizing, the max_tokens
policy. The grammar is compiled once, by the engine client beside the engine (serving/engine_loop.py
compile_grammar), never here. A prompt text so long that it must exceed the context is refused before it is tokenized.

Inputs: the ServerState (tokenizer, the engine's limits) and the body bytes.
Outputs: a Prepared request (its sequences for the engine thread), or an APIError (400) naming the field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from twospeed.serving.request_group import SequenceSpec
from twospeed.server.body import load_body, validate_sliced
from twospeed.server.errors import APIError, UnsupportedValue
from twospeed.server.tool_calls import fold_tools, template_renders_tools
from twospeed.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeChatRequest,
                                      TokenizeCompletionRequest)

_NORMALIZER_SLACK = 4  # a normalizer may shrink text (NFKC composes characters): count this many times fewer


@dataclass(slots=True)
class Prepared:
    """A request ready for admission."""

    body: CompletionRequest | ChatCompletionRequest
    prompts: list[tuple[str | None, list[int]]]  # (the prompt text, or None for token ids; its token ids)
    specs: list[SequenceSpec]  # one per choice (prompt i, sample j)


class Preparer:
    """The endpoints' preparation steps; every method runs in a worker thread (workers.py)."""

    def __init__(self, state):
        self.state = state
        self._renders_tools: bool | None = None  # whether the chat template shows `tools` (probed once)

    def _template_renders_tools(self) -> bool:
        if self._renders_tools is None:
            tokenizer = self.state.tokenizer
            self._renders_tools = template_renders_tools(
                lambda m, tools: tokenizer.apply_chat_template(m, add_generation_prompt=True, tools=tools))
        return self._renders_tools

    # -- endpoints ------------------------------------------------------------------------------
    def completion(self, raw: bytes) -> Prepared:
        body = self._parse(raw, CompletionRequest)
        texts = [p for p in body.prompts() if isinstance(p, str)]
        encoded = iter(self._encode(texts, True, "prompt"))
        prompts = [(p, next(encoded)) if isinstance(p, str) else (None, list(p)) for p in body.prompts()]
        explicit = "max_tokens" in body.model_fields_set
        specs = []
        for i, (_, ids) in enumerate(prompts):
            max_tokens = self._output_limit(body.max_tokens, explicit, len(ids), "max_tokens")
            specs += [SequenceSpec(f"cmpl-{uuid.uuid4().hex}-{i}-{j}", ids,
                                   self._params(body, max_tokens, body.logprobs, j), i * body.n + j)
                      for j in range(body.n)]
        return Prepared(body, prompts, specs)

    def chat(self, raw: bytes) -> Prepared:
        body = self._parse(raw, ChatCompletionRequest)
        text = self._render(body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs,
                            body.tool_mode)
        (ids,) = self._encode([text], False, "messages")  # the template carries its own special tokens, as HF
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        explicit = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
        max_tokens = self._output_limit(body.output_limit, explicit, len(ids), param)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        specs = [SequenceSpec(f"chatcmpl-{uuid.uuid4().hex}-{j}", ids, self._params(body, max_tokens, top_n, j), j)
                 for j in range(body.n)]
        return Prepared(body, [(None, ids)], specs)

    def tokenize(self, raw: bytes) -> dict:
        """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""
        data = load_body(raw)
        chat = isinstance(data, dict) and "messages" in data
        body = self._parse(data, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        if chat:
            if body.continue_final_message:
                raise APIError(400, "continue_final_message is not supported by this server",
                               param="continue_final_message")
            text = self._render(body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs,
                                "auto")
            param = "messages"
        else:
            text, param = body.prompt, "prompt"
        (ids,) = self._encode([text], body.add_special_tokens, param, limit=False)
        out = {"count": len(ids), "max_model_len": self.state.engine.max_model_len, "tokens": ids,
               "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = self.state.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, raw: bytes) -> dict:
        """vLLM's /detokenize: token ids -> the text they decode to."""
        body = self._parse(raw, DetokenizeRequest)
        vocab = self.state.engine.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}) (the model's vocabulary); got {bad[0]}",
                           param="tokens")
        self._need_tokenizer("tokens")
        return {"prompt": self.state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- steps ----------------------------------------------------------------------------------
    def _parse(self, raw: bytes | Any, model: type) -> Any:
        """The body (bytes, or already loaded) as `model`, its model and supported-ness checked."""
        body = validate_sliced(model, load_body(raw) if isinstance(raw, bytes) else raw)
        state = self.state
        model_name = getattr(body, "model", None)
        if model_name is not None and model_name not in (state.model_name, state.engine.config.model):
            raise APIError(400, f"the model {model_name!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        check = getattr(body, "check_supported", None)
        if check is not None:
            try:
                check()
            except UnsupportedValue as e:
                raise APIError(400, str(e), param=e.param) from None
        return body

    def _need_tokenizer(self, param: str) -> None:
        if self.state.tokenizer is None:
            raise APIError(400, "text needs a tokenizer (the server was started with skip_tokenizer_init); "
                                "send token ids", param=param)

    def _render(self, messages, add_generation_prompt: bool, tools, kwargs, tool_mode: str) -> str:
        """The conversation as the chat template renders it. Tools go to the template where it shows them to the
        model; where it does not (rendering with and without tools gives the same text), they are described in
        the system message (tool_calls.fold_tools), so a call can be asked for and parsed back all the same."""
        self._need_tokenizer("messages")
        tokenizer = self.state.tokenizer
        turns = [m.to_template() for m in messages]
        try:
            if tools and not self._template_renders_tools():
                turns, tools = fold_tools(turns, tools, tool_mode), None
            return tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt,
                                                 tools=tools or None, **(kwargs or {}))
        except APIError:
            raise
        except Exception as e:  # a template's raise_exception, a missing field, no template at all
            raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None

    def _encode(self, texts: list[str], add_special_tokens: bool, param: str, limit: bool = True) -> list[list[int]]:
        """Token ids of each text; with `limit`, a text that cannot fit max_model_len is refused untokenized."""
        if not texts:
            return []
        self._need_tokenizer(param)
        tokenizer, limits = self.state.tokenizer, self.state.engine.limits
        what = "the prompt" if param == "prompt" else "the conversation, as the chat template renders it,"
        for text in texts if limit else ():
            at_least = len(text) // (tokenizer.max_token_chars * _NORMALIZER_SLACK)
            if at_least > limits.max_model_len:
                raise APIError(400, f"{what} has at least {at_least:,} tokens ({len(text):,} characters) but "
                                    f"{limits.len_limit} is {limits.max_model_len}", param=param)
        return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)

    def _output_limit(self, requested: int | None, explicit: bool, prompt_len: int, param: str) -> int | None:
        """max_tokens under the server's policy (ServerConfig.max_tokens_policy)."""
        max_len = self.state.engine.max_model_len
        room = max_len - prompt_len
        if (requested is not None and explicit and requested > room > 0
                and self.state.config.max_tokens_policy == "error"):
            raise APIError(400, f"{param} is too large: {requested}. This model's maximum context length is {max_len} "
                                f"tokens and your request has {prompt_len} input tokens ({requested} > {max_len} - "
                                f"{prompt_len}); lower {param}, or start the server with --max-tokens-policy clamp",
                           param=param)
        return requested

    @staticmethod
    def _params(body, max_tokens: int | None, logprobs: int | None, j: int):
        try:
            return body.sampling_params(max_tokens, logprobs, j)
        except ValueError as e:
            param = getattr(e, "param", None)
            raise APIError(400, str(e), param=body.structured_param if param == "structured" else param) from None
