"""Request models of the OpenAI-compatible API (pydantic), and the conversion to SamplingParams.

Strict types, as OpenAI's API checks them: "5" is not a number, 1.0 is not a count. Fields
OpenAI defines that twospeed does not implement are accepted at their neutral value and
refused (400, naming the field) otherwise, never silently ignored. Unknown fields are
ignored, as vLLM does, so newer clients keep working.

twospeed extras (vLLM's names where vLLM has one): top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output, priority,
return_token_ids (the choice's token ids), and `lane` (the SLO lane; also the
x-twospeed-lane header).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from twospeed.engine.sampling_params import SamplingParams

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # as OpenAI
MAX_STOP = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator accepts

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _integral(value: Any) -> Any:
    # JSON Schema's "integer" admits 4.0; strings and 4.5 stay errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class UnsupportedValue(ValueError):
    """A field OpenAI defines, set to a value twospeed does not implement."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


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
    frequency_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    user: str | None = None
    lane: str | None = Field(None, description="SLO lane (also the x-twospeed-lane header); default 'default'")
    priority: Int | None = Field(None, ge=-(2**31), le=2**31 - 1,
                                 description="scheduling priority (lower first) with --scheduling-policy priority")
    return_token_ids: bool = False

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options is only allowed when stream is true")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise UnsupportedValue(name, f"{name} is not supported by this server (send 0 or leave it out)")
        if self.logit_bias:
            raise UnsupportedValue("logit_bias", "logit_bias is not supported by this server")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise UnsupportedValue("stop", f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise UnsupportedValue("stop", "stop strings must be non-empty")

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
            skip_special_tokens=self.skip_special_tokens)


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
        if self.echo and self.logprobs is not None:
            raise UnsupportedValue("echo", "echo with logprobs (prompt logprobs) is not supported by this server")

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


class ContentPart(_Model):
    type: Literal["text"]  # images and audio are not supported
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        """The message as a chat template reads it: content parts joined to one string."""
        out = self.model_dump(exclude_none=True)
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise UnsupportedValue("messages", f"a {self.role!r} message needs content")
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs requires logprobs: true")
        if self.tools:
            raise UnsupportedValue("tools", "tools are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise UnsupportedValue("tool_choice", "tool_choice is not supported by this server")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise UnsupportedValue("response_format", "only response_format {\"type\": \"text\"} is supported")
        if self.modalities is not None and self.modalities != ["text"]:
            raise UnsupportedValue("modalities", "only the text modality is supported")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
