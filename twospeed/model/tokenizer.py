"""Tokenizer of a checkpoint: encode/decode, chat template, streaming detokenizer.

Inputs: tokenizer.json (through the `tokenizers` library; transformers is never imported
here) and the small JSON files beside it that name the special tokens, the eos ids and the
chat template; or a GGUF file's metadata, rebuilt as the same kind of `tokenizers` object
(model/gguf_tokenizer.py). `apply_chat_template` renders as transformers' does
(transformers/utils/chat_template_utils.py), so a chat prompt, and therefore its prefix-cache
hits, are token for token what an HF user gets. `IncrementalDetokenizer` is vLLM's
prefix/read-offset technique (vllm/transformers_utils/detokenizer_utils.py) plus stop strings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from twospeed.model.checkpoint_files import find_gguf

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # HF aliases these for templates
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, as vLLM: gives the leading space its context


class Tokenizer:
    """A fast tokenizer plus the checkpoint's special tokens, eos ids and chat template(s)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict[str, str] | None = None,
                 bos_token_id: int | None = None, eos_token_ids: frozenset[int] = frozenset(),
                 chat_templates: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>"}: template variables
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_templates = dict(chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}
        self._max_token_chars: int | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint folder (tokenizer.json and the files beside it), or of a GGUF file (or a
        folder holding one and no tokenizer.json): rebuilt from its metadata (model/gguf_tokenizer.py)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file() and (gguf_file := find_gguf(path)) is not None:
            return cls.from_gguf(gguf_file)
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found: twospeed needs a fast tokenizer (tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust error names no file
            raise ValueError(f"cannot read {tokenizer_file}: {e}") from e
        tok_cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        special = {k: c for k in _SPECIAL_TOKEN_KEYS if (c := _token_content(tok_cfg.get(k))) is not None}
        bos_ids = [backend.token_to_id(special["bos_token"])] if "bos_token" in special else []
        bos_ids += sorted(_id_set(gen_cfg.get("bos_token_id"))) + sorted(_id_set(model_cfg.get("bos_token_id")))
        eos_ids = _id_set(gen_cfg.get("eos_token_id")) | _id_set(model_cfg.get("eos_token_id"))
        if "eos_token" in special and (eos_id := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids.add(eos_id)
        # add_bos_token / add_eos_token are ignored on purpose: with a tokenizer.json present
        # transformers 5 ignores them too, and tokenizer.json's post-processor decides.
        return cls(backend, special_tokens=special, bos_token_id=next((i for i in bos_ids if i is not None), None),
                   eos_token_ids=frozenset(eos_ids), chat_templates=_read_chat_templates(path, tok_cfg))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from twospeed.model.gguf_tokenizer import load_gguf_tokenizer

        t = load_gguf_tokenizer(path)
        return cls(t.backend, special_tokens=t.special_tokens, bos_token_id=t.bos_token_id,
                   eos_token_ids=t.eos_token_ids, chat_templates=t.chat_templates)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text. `tokenizers` releases the GIL while it works here (encode() holds it), so a
        long text tokenized in a worker thread does not stall the others (the server's event loop)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (added tokens included): a text of n characters has at
        least n / max_token_chars tokens, before normalization."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Render a conversation to the prompt text (encode it with add_special_tokens=False, as HF does)."""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        # Same choice as HF's get_chat_template: a "tool_use" template wins when tools are given.
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json has no 'chat_template' "
                             "and there is no chat_template.jinja); send a plain completion prompt instead")
        if name not in self._compiled:
            self._compiled[name] = _compile_template(self.chat_templates[name])
        variables = {**self.special_tokens, "documents": None, **kwargs}
        return self._compiled[name].render(**variables, messages=[_template_message(m) for m in messages],
                                           tools=tools, add_generation_prompt=add_generation_prompt)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, for streaming, and finds stop
    strings across token boundaries.

    Emitted text is final: a character split over byte-level tokens waits for its last byte, and
    while stop strings are set, a tail that could still grow into one waits for the next tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings only count once this many tokens were added
        self._num_tokens = 0
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.output_text = ""
        self.stop_hit: str | None = None
        self._max_stop = max(map(len, self.stop), default=0)
        # Only the last few prompt tokens matter: they set the first output token's leading space.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0              # _ids[_prefix_offset:_read_offset]: context, already in output_text
        self._read_offset = len(self._ids)   # _ids[_read_offset:]: not yet in output_text
        self._emitted = 0                    # output_text[:_emitted] was returned by take_delta
        self._finished = False

    def add_tokens(self, new_token_ids: Sequence[int]) -> str | None:
        """Append sampled ids; return the stop string if one now appears in the text, else None."""
        if self.stop_hit is not None or self._finished:
            return None  # the request is over; late tokens (e.g. the rest of a speculative run) are dropped
        self._ids.extend(new_token_ids)
        self._num_tokens += len(new_token_ids)
        return self._append(self._decode_new(flush=False))

    def finish(self) -> None:
        """No more tokens: flush held-back text, even a trailing incomplete UTF-8 sequence ("\ufffd")."""
        if self.stop_hit is None and not self._finished:
            self._append(self._decode_new(flush=True))
        self._finished = True

    def take_delta(self) -> str:
        """The text not returned before that can no longer change or become part of a stop string."""
        end = len(self.output_text)
        if self.stop and self.stop_hit is None and not self._finished:
            # Hold back the shortest tail that is still the start of some stop string.
            for i in range(max(self._emitted, end - self._max_stop + 1), end):
                tail = self.output_text[i:]
                if any(s.startswith(tail) for s in self.stop):
                    end = i
                    break
        delta = self.output_text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def _decode_new(self, flush: bool) -> str:
        # Decode context + new ids and keep what lies beyond the context's text: costs
        # O(new tokens), and the context gives the first new token its leading space.
        ids, decode = self._ids, self.tokenizer.decode
        prefix_text = decode(ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full_text = decode(ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not flush):
            # Nothing new, or a UTF-8 character split across byte-level tokens: wait for the rest.
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full_text[len(prefix_text):]

    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        start = max(0, len(self.output_text) - self._max_stop + 1)  # a stop may begin in the old text
        self.output_text += new_text
        if self._num_tokens < self.min_tokens:
            return None
        hits = [(i, s) for s in self.stop if (i := self.output_text.find(s, start)) >= 0]
        if not hits:
            return None
        # The stop that completes first in the character stream (then the longer one), so the
        # result does not depend on how the text was split into tokens or calls.
        index, self.stop_hit = min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]))
        self.output_text = self.output_text[:index + (len(self.stop_hit) if self.include_stop_str_in_output else 0)]
        self._emitted = min(self._emitted, len(self.output_text))
        return self.stop_hit


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # AddedToken dicts carry "content"


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _read_chat_templates(path: Path, tok_cfg: dict) -> dict[str, str]:
    # transformers 5 writes chat_template.jinja; when present it wins over tokenizer_config.json.
    if (jinja_file := path / "chat_template.jinja").is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    raw = tok_cfg.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw}
    return {}


def _template_message(message: dict) -> dict:
    # As HF: drop None values (OpenAI sends content=None with tool calls) and copy reasoning
    # text to the names templates read.
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore attributes (a sandbox hardening HF applies too)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick: namespace(self=...))
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; templates want plain JSON, as HF renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    return env.from_string(source)
