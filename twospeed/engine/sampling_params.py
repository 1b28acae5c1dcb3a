"""Per-request sampling and stopping parameters, validated on construction.

These are the checks that need no model; engine/admission.py adds those against the model (vocabulary,
context length) and holds the table of every rule.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-40 overflows to inf,
# and softmax over infs is NaN, where the limit of ever-colder sampling is the argmax.
GREEDY_TEMPERATURE = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator accepts


class InvalidParam(ValueError):
    """A request field that breaks an admission rule; `param` names the field (the server's 400 says which)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole (the engine process sends it to the server as it was raised)
        return type(self), (self.param, str(self))


@dataclass(slots=True)
class StructuredOutput:
    """What a constrained request's output must match: set exactly one of json, json_object, regex,
    choice, grammar. Compiled by twospeed/engine/structured.py (llguidance) when the request is added.

    JSON schemas compile to compact JSON (no optional whitespace: a weak model would otherwise pad
    with it); a schema's own "x-guidance" options (llguidance's) override that.
    """

    json: dict[str, Any] | bool | str | None = None  # a JSON schema (dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches this regex (Rust regex syntax)
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or a GBNF/EBNF one
    jump_forward: bool = True  # append tokens the grammar forces without a forward pass of their own

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise InvalidParam("structured", f"structured output: the JSON schema is not valid JSON: {e}") from e
        given = [name for name, value in (("json", self.json), ("json_object", self.json_object or None),
                                          ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar)) if value is not None]
        if len(given) != 1:
            raise InvalidParam("structured", "structured output needs exactly one of json, json_object, regex, "
                                             f"choice, grammar; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidParam("structured", "structured output: a JSON schema is an object or a boolean, "
                                             f"got {type(self.json).__name__}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidParam("structured",
                                   "structured output: choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidParam("structured", f"structured output: {name} must be a non-empty string")

    @property
    def kind(self) -> str:
        if self.json is not None:  # a schema may be the boolean false (nothing matches: admission refuses it)
            return "json"
        return next(k for k in ("json_object", "regex", "choice", "grammar") if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """The content the compiled grammar depends on (the compile cache's key)."""
        kind = self.kind
        value = {"json_object": True}.get(kind, getattr(self, kind))
        return kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(slots=True)
class SamplingParams:
    """As vLLM names them. temperature 0 is greedy; top_k 0 or -1 and top_p 1 and min_p 0 disable those filters."""

    max_tokens: int | None = 16  # output tokens at most; None = up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were emitted
    temperature: float = 1.0  # 0 (anything below GREEDY_TEMPERATURE) is greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: the same tokens whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-n logprobs of each output token (plus the sampled one)
    # vLLM's: top-n logprobs of each prompt token after the first (plus the prompt's own token). The request then
    # computes every prompt position (no prefix-cache hit: a cached position has no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | dict[str, Any] | None = None  # constrained output; a dict is a JSON schema
    speculate: bool | None = None  # False: never speculate for this request; None/True: as the engine is set
    # OpenAI's: subtracted from a token's logit once it appeared in the output (presence) and per appearance
    # (frequency); in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/HF's: a token seen in the prompt or the output has its logit divided by this when positive, multiplied
    # when negative; 1 disables it
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        if isinstance(self.structured, dict):
            self.structured = StructuredOutput(json=self.structured)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidParam("structured", f"structured must be a StructuredOutput or a JSON schema dict, "
                                             f"got {type(self.structured).__name__}")
        if self.structured is not None and self.min_tokens:
            raise InvalidParam("min_tokens", "min_tokens cannot be combined with structured output: the grammar "
                                             "decides where the document ends")
        self._check_types()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidParam("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidParam("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidParam("top_k",
                               f"top_k must be -1 or 0 (disabled) or a positive count, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidParam("seed", f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidParam(name, f"{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty strings")
        if any(not valid_unicode(s) for s in self.stop):
            raise InvalidParam("stop", "stop strings must be valid Unicode (no lone surrogates)")
        if self.top_k == -1:
            self.top_k = 0
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise InvalidParam("repetition_penalty",
                               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            self._check_logit_bias()

    def _check_types(self) -> None:
        """Counts are integers (numpy's too, not bools), rates numbers, flags booleans: a float token id or a
        string temperature would otherwise fail later, inside a batched step."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.max_tokens = None if self.max_tokens is None else _int("max_tokens", self.max_tokens)
        self.min_tokens = _int("min_tokens", self.min_tokens)
        self.top_k = _int("top_k", self.top_k)
        self.seed = None if self.seed is None else _int("seed", self.seed)
        self.logprobs = None if self.logprobs is None else _int("logprobs", self.logprobs)
        self.prompt_logprobs = None if self.prompt_logprobs is None else _int("prompt_logprobs", self.prompt_logprobs)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidParam("stop_token_ids",
                               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = [_int("stop_token_ids", t) for t in self.stop_token_ids]
        self.temperature, self.top_p, self.min_p = (_float(name, getattr(self, name))
                                                    for name in ("temperature", "top_p", "min_p"))
        self.presence_penalty, self.frequency_penalty, self.repetition_penalty = (
            _float(name, getattr(self, name)) for name in ("presence_penalty", "frequency_penalty",
                                                           "repetition_penalty"))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidParam(name, f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculate is not None and not isinstance(self.speculate, bool):
            raise InvalidParam("speculate", f"speculate must be true, false or null, got {self.speculate!r}")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidParam("logit_bias", f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        bias = {}
        for token, value in self.logit_bias.items():
            token, value = _int("logit_bias", token), _float("logit_bias", value)
            if not -100.0 <= value <= 100.0:
                raise InvalidParam("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for {token}")
            if token < 0:
                raise InvalidParam("logit_bias", f"logit_bias keys are token ids >= 0, got {token}")
            bias[token] = value
        self.logit_bias = bias or None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """logit_bias or a penalty changes this request's logits before it is sampled."""
        return (self.logit_bias is not None or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _int(name: str, value: Any) -> int:
    # numpy integers are fine; a bool is not a count, a float is not an id.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParam(name, f"{name} must be a number, got {value!r}")
    return float(value)


def valid_unicode(text: str) -> bool:
    """False for text with a lone surrogate (no UTF-8 spelling), which tokenizers and JSON encoders reject."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
