"""Request models of the OpenAI-compatible API (pydantic), and the conversion to SamplingParams.

Strict types, as OpenAI's API checks them: "5" is not a number, 1.0 is not a count. Fields
OpenAI defines that twospeed does not implement are accepted at their neutral value and
refused (400, naming the field) otherwise, never silently ignored. Unknown fields are
ignored, as vLLM does, so newer clients keep working.

OpenAI's sampling controls: logit_bias (token id -> [-100, 100]), presence_penalty and frequency_penalty
([-2, 2], over the output). twospeed extras (vLLM's names where vLLM has one): top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output, priority,
return_token_ids (the choice's token ids), `lane` (the SLO lane; also the
x-twospeed-lane header) and `speculate` (false: no speculative decoding for this
request, whatever the server's --spec-method).

Structured output: `response_format` (json_object, json_schema) on both endpoints, vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` ({"json" | "regex" | "choice" |
"grammar" | "json_object"}), and `tools` + `tool_choice` on chat, become a StructuredOutput the engine compiles
(llguidance); at most one of them a request. vLLM extras that change the output and are not implemented here
(beam search, allowed_token_ids, bad_words, ...) are a 400 naming the field when set, never
ignored. Objects in those schemas
admit only their declared properties (engine/json_schema.closed, as OpenAI's strict mode and xgrammar) unless
the schema says otherwise; `"strict": false` on the json_schema or the function restores JSON Schema's open
default. A tool call is
generated as one compact JSON object {"name": ..., "arguments": {...}} whose arguments follow the
function's parameters schema; with tool_choice "auto" the grammar allows either that object or free
text that does not start with "{" (so the first character decides, and streaming can pass text through).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, WithJsonSchema

from twospeed.engine import json_schema
from twospeed.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutput
from twospeed.server.errors import UnsupportedValue
from twospeed.server.messages import ChatMessage, ContentPart, check_conversation  # noqa: F401 (re-exported)
from twospeed.server.tool_calls import (FUNCTION_NAME, RESPONSE_FORMAT_SCHEMA, TOOL_CHOICE_SCHEMA, TOOLS_SCHEMA,
                                        parse_call, partial_call, tool_call_schema)

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # as OpenAI
MAX_STOP = 16

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _integral(value: Any) -> Any:
    # JSON Schema's "integer" admits 4.0; strings and 4.5 stay errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def check_schema(schema: Any, param: str, where: str) -> dict | bool:
    """A JSON schema checked against its meta-schema and for a finite document (once per distinct schema);
    a 400 naming where it is wrong otherwise."""
    if not isinstance(schema, (dict, bool)):
        raise UnsupportedValue(param, f"{where} must be a JSON schema object")
    try:
        json_schema.check_schema(schema)
    except json_schema.SchemaProblem as e:
        at = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise UnsupportedValue(param, f"{where}{at} {e.reason}") from None
    return schema


# vLLM's request extras that change what is generated and are not implemented here: a 400 when set to anything
# but their neutral value (None: any value), never silently ignored.
VLLM_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None,
    "bad_words": None, "truncate_prompt_tokens": None, "guided_whitespace_pattern": None, "logits_processors": None,
    "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True, "vllm_xargs": None,
    "guided_decoding": None,
}
# structured_outputs' options besides the kind: JSON is compact here already (disable_any_whitespace holds either
# way), and disable_additional_properties false leaves a schema's objects open; the rest are refused
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


def _structured(param: str, **kind) -> StructuredOutput:
    try:
        return StructuredOutput(**kind)
    except ValueError as e:
        raise UnsupportedValue(param, f"{param}: {e}") from None


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False


class _SamplingRequest(_Model):
    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    max_tokens: Int | None = Field(None, ge=1)
    temperature: FiniteFloat | None = Field(None, ge=0)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)
    min_p: FiniteFloat | None = Field(None, ge=0, le=1)
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[Int] | None = Field(None, max_length=64)
    min_tokens: Int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: FiniteFloat | None = Field(None, gt=0)
    logit_bias: dict[str, Annotated[FiniteFloat, Field(ge=-100, le=100)]] | None = None
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's; not with stream, as there
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    lane: str | None = Field(None, description="SLO lane (also the x-twospeed-lane header); default 'default'")
    priority: Int | None = Field(None, ge=-(2**31), le=2**31 - 1,
                                 description="scheduling priority (lower first) with --scheduling-policy priority")
    return_token_ids: bool = False
    speculate: bool | None = Field(None, description="false: decode this request without speculation")
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None
    _structured: Any = PrivateAttr(default=False)  # structured_output(), computed once (False: not yet)

    def check_supported(self) -> None:
        self.response_format_output()  # raises on a malformed response_format or an invalid schema
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options is only allowed when stream is true")
        self.token_bias()  # raises on keys that are not token ids
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedValue("prompt_logprobs", "prompt_logprobs are not available when stream is enabled")
        for name, neutral in VLLM_UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value != neutral:
                raise UnsupportedValue(name, f"{name} is not supported by this server (vLLM's extra; "
                                             f"leave it out{'' if neutral is None else f' or send {neutral!r}'})")
        guided = self._guided_fields()
        if len(guided) > 1 or (guided and self.response_format_output() is not None):
            both = guided + (["response_format"] if self.response_format_output() is not None else [])
            raise UnsupportedValue(both[-1], f"one structured output a request: got {', '.join(both)}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise UnsupportedValue("stop", f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise UnsupportedValue("stop", "stop strings must be non-empty")

    def response_format_output(self) -> StructuredOutput | None:
        """response_format as a StructuredOutput: None for text, any object for json_object, the schema
        for json_schema."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return StructuredOutput(json_object=True)
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise UnsupportedValue("response_format", "response_format json_schema needs a \"json_schema\" "
                                                          "object with a \"schema\" (a JSON schema object)")
            schema = check_schema(spec.get("schema", {"type": "object"}), "response_format",
                                  "response_format.json_schema.schema")
            return StructuredOutput(json=schema if spec.get("strict") is False else json_schema.closed(schema))
        raise UnsupportedValue("response_format", f"response_format type {rf.get('type')!r} is not supported "
                                                  "(use text, json_object or json_schema)")

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids (OpenAI sends them as JSON object keys: strings of integers)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key) if len(key) <= 12 else None
            except ValueError:
                token = None
            if token is None or token < 0 or key.strip() != key:
                raise UnsupportedValue("logit_bias", f"logit_bias keys are token ids (integers >= 0), got {key!r}")
            out[token] = value
        return out

    def _guided_fields(self) -> list[str]:
        return [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
                if getattr(self, n) is not None]

    def guided_output(self) -> StructuredOutput | None:
        """vLLM's spellings of structured output as the engine's own (None when the request uses none)."""
        given = self._guided_fields()
        if not given:
            return None
        param = given[0]
        if param == "structured_outputs":
            so = {k: v for k, v in self.structured_outputs.items() if v is not None and k not in STRUCTURED_OPTIONS}
            if len(so) != 1 or not set(so) <= {"json", "regex", "choice", "grammar", "json_object"}:
                raise UnsupportedValue(param, "structured_outputs takes exactly one of json, regex, choice, grammar, "
                                              f"json_object (options: {', '.join(STRUCTURED_OPTIONS)}); got "
                                              f"{sorted(so)}")
            (kind, value), = so.items()
            close, where = self.structured_outputs.get("disable_additional_properties") is not False, f"{param}.json"
        else:
            kind, value, close, where = param.removeprefix("guided_"), getattr(self, param), True, param
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise UnsupportedValue(param, f"{where} is not valid JSON: {e}") from None
            schema = check_schema(value, param, where)
            return StructuredOutput(json=json_schema.closed(schema) if close else schema)
        if kind == "json_object":
            return StructuredOutput(json_object=True)
        return _structured(param, **{kind: value})

    def structured_output(self) -> StructuredOutput | None:
        """The request's constrained output (computed once: its schemas are checked then)."""
        if self._structured is False:
            self._structured = self._structured_output()
        return self._structured

    def _structured_output(self) -> StructuredOutput | None:
        return self.guided_output() or self.response_format_output()

    @property
    def structured_param(self) -> str | None:
        """The field a grammar compile error is blamed on."""
        if guided := self._guided_fields():
            return guided[0]
        return "response_format" if self.response_format_output() is not None else None

    def engine_prompt_logprobs(self) -> int | None:
        """The top-n the engine scores each prompt token with (None: it scores none)."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = self.seed
        if seed is not None and seed_offset:  # n > 1: different samples, still reproducible
            seed = (seed + seed_offset - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p or 0.0,
            seed=seed, stop=stops, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured=self.structured_output(),
            speculate=self.speculate, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.token_bias(), prompt_logprobs=self.engine_prompt_logprobs())


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | Annotated[list[Int], Field(min_length=1)]
             | Annotated[list[Annotated[list[Int], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = Field(None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise UnsupportedValue("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedValue("best_of", "best_of other than n is not supported by this server")
        if self.echo and self.logprobs is not None and self.stream:
            raise UnsupportedValue("echo", "echo with logprobs is not available when stream is enabled (it needs "
                                           "the prompt's logprobs)")

    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (OpenAI's legacy completions: the echoed tokens' logprobs)."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        asked = [n for n in (self.prompt_logprobs, echoed) if n is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, a list of strings, token ids, or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            batch = [p]
        elif p and isinstance(p[0], int):
            batch = [p]
        else:
            batch = list(p)
        if not batch:
            raise UnsupportedValue("prompt", "prompt must not be empty")
        for item in batch:
            if len(item) == 0:
                raise UnsupportedValue("prompt", "prompt must not be empty")
        return batch


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    tool_choice: Annotated[Any, WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    _functions: dict | None = PrivateAttr(default=None)

    def check_supported(self) -> None:
        super().check_supported()
        check_conversation(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs requires logprobs: true")
        functions = self.functions()
        if self.tool_mode != "none" and self.response_format_output() is not None:
            raise UnsupportedValue("response_format", "response_format cannot be combined with tools unless "
                                                      "tool_choice is \"none\"")
        if self.tool_mode != "none" and (guided := self._guided_fields()):
            raise UnsupportedValue(guided[0], f"{guided[0]} cannot be combined with tools unless tool_choice is "
                                              "\"none\"")
        if self.tool_mode not in ("none", "auto", "required") and self.tool_mode not in functions:
            raise UnsupportedValue("tool_choice", f"tool_choice names function {self.tool_mode!r}, which is not "
                                                  f"in tools ({', '.join(functions) or 'none given'})")
        if self.modalities is not None and self.modalities != ["text"]:
            raise UnsupportedValue("modalities", "only the text modality is supported")

    def functions(self) -> dict[str, dict]:
        """The tools' functions by name, each with a checked parameters schema (checked once)."""
        if self._functions is None:
            self._functions = self._read_functions()
        return self._functions

    def _read_functions(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict):
                raise UnsupportedValue("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
                raise UnsupportedValue("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ or -; "
                                                f"got {name!r}")
            if name in out:
                raise UnsupportedValue("tools", f"tools[{i}]: function {name!r} is defined twice")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            params = check_schema(params, "tools", f"tools[{i}].function.parameters")
            out[name] = params if fn.get("strict") is False else json_schema.closed(params)
        return out

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or the name of the function tool_choice forces."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice in ("none", "auto", "required"):
            if choice != "none" and not self.tools:
                raise UnsupportedValue("tool_choice", f"tool_choice {choice!r} needs tools")
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
                and isinstance(choice["function"].get("name"), str):
            return choice["function"]["name"]
        raise UnsupportedValue("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")

    def _structured_output(self) -> StructuredOutput | None:
        mode = self.tool_mode
        if mode == "none":
            return self.guided_output() or self.response_format_output()
        functions = self.functions()
        if mode not in ("auto", "required"):
            functions = {mode: functions[mode]}
        call = tool_call_schema(functions)
        if mode != "auto":
            return StructuredOutput(json=call)
        # Free text (not starting with "{", so the first character decides) or one tool call.
        compact = {"x-guidance": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}, **call}
        return StructuredOutput(grammar=f"start: call | TEXT\ncall: %json {json.dumps(compact)}\n"
                                        "TEXT: /[^{][\\s\\S]*/\n")

    @property
    def structured_param(self) -> str | None:
        if self.tool_mode != "none":
            return "tools"
        return super().structured_param

    def parse_tool_call(self, text: str) -> dict | None:
        """The {"name", "arguments"} object a tool grammar produced, or None for plain text / a cut-off call."""
        return None if self.tool_mode == "none" else parse_call(text, self.functions())

    def partial_tool_call(self, text: str) -> dict | None:
        """A call cut off by max_tokens ({"name", "arguments": the JSON text so far}), or None for plain text."""
        if self.tool_mode == "none":
            return None
        functions = self.functions()
        if self.tool_mode not in ("auto", "required"):
            functions = {self.tool_mode: functions[self.tool_mode]}
        return partial_call(text, functions)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------------
class TokenizeCompletionRequest(_Model):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Model):
    """POST /tokenize with messages: the prompt the chat template renders, as /v1/chat/completions would."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Model):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Int]
