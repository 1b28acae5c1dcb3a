"""Admission: every per-request field checked against the model before anything is allocated.

A request that passes can never make a step raise: a bad field is an InvalidParam (a ValueError whose
`param` names the field; HTTP 400),
raised by `LLMEngine.add_request` before the request holds a KV block. SamplingParams checks what needs
no model when it is built; this module adds what does. The whole table (tests/engine/test_admission.py
tests each row):

| field | rule | checked by |
| --- | --- | --- |
| prompt | non-empty; integers (not bools) in [0, vocab_size); fewer tokens than max_model_len | here |
| request_id | not in use by an unfinished request | Scheduler.add_request |
| max_tokens | an integer >= 1, or None (= the room left); beyond the room: clamped (the server: 400) | SamplingParams |
| min_tokens | an integer in [0, max_tokens]; not with structured output; at most the room left | SamplingParams; here (room) |
| temperature | a finite number >= 0; below GREEDY_TEMPERATURE (1e-5) it is greedy | SamplingParams |
| top_k | an integer >= -1 (0 and -1 disable it; at least the vocabulary also does) | SamplingParams |
| top_p | a number in (0, 1] | SamplingParams |
| min_p | a number in [0, 1] | SamplingParams |
| seed | None, or an integer in [-2**63, 2**64 - 1] (what a torch.Generator takes) | SamplingParams |
| stop | non-empty strings of valid Unicode (no lone surrogates) | SamplingParams |
| stop_token_ids | integers in [0, vocab_size) | SamplingParams (type); here (range) |
| logprobs | None, or an integer in [0, vocab_size] | SamplingParams (type); here (range) |
| presence_penalty, frequency_penalty | numbers in [-2, 2] | SamplingParams |
| repetition_penalty | a finite number > 0 | SamplingParams |
| logit_bias | token ids in [0, vocab_size) to numbers in [-100, 100] | SamplingParams (type, values); here (ids) |
| ignore_eos, include_stop_str_in_output, skip_special_tokens | booleans | SamplingParams |
| structured | one kind; a schema valid and admitting a finite document; a regex/grammar that compiles | structured.py |
| priority | an integer | here |

The server refuses a max_tokens the client set beyond the room (unless `--max-tokens-policy clamp`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from twospeed.engine.sampling_params import InvalidParam, SamplingParams


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What admission checks a request against."""

    vocab_size: int  # token ids must be below this (the logits' width)
    max_model_len: int  # tokens (prompt + output) one request may hold
    len_limit: str = "max_model_len"  # how messages name max_model_len (it may be limited by the KV pool)


def check_prompt(prompt: Sequence, limits: ModelLimits) -> list[int]:
    """The prompt's token ids as ints; ValueError if one is not a token of this model or they do not fit."""
    if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes)):
        raise InvalidParam("prompt",
                           f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in prompt):
        bad = next(t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral))
        raise InvalidParam("prompt", f"prompt token ids must be integers, got {bad!r}")
    ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidParam("prompt", "the prompt is empty")
    vocab = limits.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise InvalidParam("prompt", f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
    if len(ids) >= limits.max_model_len:
        raise InvalidParam("prompt", f"the prompt has {len(ids)} tokens but {limits.len_limit} is "
                                     f"{limits.max_model_len} (the prompt and at least one output token must fit)")
    return ids


def check_params(params: SamplingParams, limits: ModelLimits, priority: int = 0, prompt_len: int | None = None) -> None:
    """The model-dependent rules of the table; ValueError naming the field otherwise. prompt_len: the checked
    prompt's length, for the rules on the room it leaves."""
    vocab = limits.vocab_size
    if params.logit_bias is not None and (bad := [t for t in params.logit_bias if t >= vocab]):
        raise InvalidParam("logit_bias", f"logit_bias keys must be token ids in [0, {vocab}); got {bad[0]}")
    if prompt_len is not None and params.min_tokens > limits.max_model_len - prompt_len:
        raise InvalidParam("min_tokens", f"min_tokens is {params.min_tokens} but the prompt's {prompt_len} tokens "
                                         f"leave room for {limits.max_model_len - prompt_len} ({limits.len_limit} "
                                         f"{limits.max_model_len})")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidParam("stop_token_ids",
                           f"stop_token_ids must be in [0, {vocab}) (the model's vocabulary); got {bad[0]}")
    if params.logprobs is not None and params.logprobs > vocab:
        raise InvalidParam("logprobs",
                           f"logprobs asks for the top {params.logprobs} tokens but the vocabulary has {vocab}")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise InvalidParam("priority", f"priority must be an integer, got {priority!r}")
