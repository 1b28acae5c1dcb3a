"""The tokenizer a GGUF file describes, built as a `tokenizers` Tokenizer (no torch: the server's process loads it).

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges, scores, token types and special ids as
metadata. Two vocabularies of the Llama family are rebuilt here, as transformers' GGUF conversion builds them
(its tokenizers are the reference the tests compare with):

- `gpt2`: byte-level BPE with the file's merges; `tokenizer.ggml.pre` names how text is split before BPE (the
  regex its merges were learned with: "llama-bpe", "qwen2", "smollm", ...).
- `llama`: SentencePiece BPE: merges from the file or, as usual, recovered from the scores; "▁" for spaces, a
  prefix space on the first word, byte fallback (<0x..> tokens) for characters the vocabulary lacks.

Control and unknown tokens become special added tokens (matched whole, as llama.cpp matches them; dropped by
skip_special_tokens), user-defined ones plain added tokens; BOS/EOS (and llama.cpp's end-of-turn ids) and add_bos come from the metadata, the chat
template from `tokenizer.chat_template`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from twospeed.model.checkpoint_files import CheckpointError, gguf_reader

log = logging.getLogger(__name__)

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types (gguf.TokenType)

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre-tokenizer name -> the regex its merges were learned with (then byte-level, no regex of its own)
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")})
# digits one by one, then GPT-2's split (the StarCoder family and SmolLM)
_DIGIT_SPLITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


@dataclass
class GGUFTokenizer:
    """What tokenizer.py's Tokenizer is built from."""

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str] = field(default_factory=dict)  # {"bos_token": "<s>", ...}: template variables
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    add_bos: bool = False
    chat_templates: dict[str, str] = field(default_factory=dict)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: how a byte-level vocabulary spells bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = dict(zip(keep, map(chr, keep))), 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(chars.items()))


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata value of a GGUF file (vocabularies as lists)."""
    return {name: f.contents() for name, f in gguf_reader(path).fields.items()}


def load_gguf_tokenizer(path: str | Path, metadata: dict[str, Any] | None = None) -> GGUFTokenizer:
    """The tokenizer of GGUF file `path` (its metadata, if already read, in `metadata`)."""
    meta = metadata if metadata is not None else read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError(f"{Path(path).name}: no vocabulary (tokenizer.ggml.tokens); pass a tokenizer folder")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend, spelled = _byte_level(meta, tokens), set(bytes_to_unicode().values())
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        backend, spelled = _sentencepiece(meta, tokens), None
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for these
    else:
        raise CheckpointError(f"{Path(path).name}: tokenizer {kind!r} is not supported (gpt2: byte-level BPE, llama: "
                              "SentencePiece); pass a tokenizer folder with --tokenizer")
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in
           (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"))}
    if ids["unk_token"] is None:  # the token typed UNKNOWN is the unknown token (SentencePiece's <unk>)
        ids["unk_token"] = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
    special = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
    vocab = backend.get_vocab()
    # A byte-level vocabulary spells every token in its byte alphabet: a control token outside it is a mislabel
    # that would grow the vocabulary past the model's, so it stays out (as transformers leaves it).
    controls = [t for t, ty in zip(tokens, types)
                if ty in (CONTROL, UNKNOWN) and (spelled is None or set(t) <= spelled)]
    controls += [t for t in special.values() if t not in controls and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in controls])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = special.get("bos_token") if add_bos else None, special.get("eos_token") if add_eos else None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in (bos, eos) if t])
    eos_ids = frozenset(i for key in ("eos_token_id", "eot_token_id", "eom_token_id")
                        if (i := meta.get(f"tokenizer.ggml.{key}")) is not None)
    return GGUFTokenizer(backend, special, ids["bos_token"], eos_ids, add_bos, _chat_templates(meta))


def _merges(meta: dict[str, Any], vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    if meta.get("tokenizer.ggml.merges"):
        return [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    return merges_from_scores(vocab, scores)


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every split of a token into two tokens, the best-scored token's first
    (SentencePiece files store scores, not merges); ties by the pieces' lengths and ids, as transformers orders."""
    ranked = scores if scores is not None else vocab
    merges = []
    for token, score in ranked.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=scores is not None)
    return [(a, b) for a, b, _ in merges]


def _byte_level(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=_merges(meta, vocab, None), dropout=None,
                                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        if pre not in ("default", "gpt2", "gpt-2"):
            log.warning("GGUF pre-tokenizer %r is not known here: splitting as GPT-2 does", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(meta: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = meta.get("tokenizer.ggml.scores")
    ranked = dict(zip(tokens, scores)) if scores else None
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=_merges(meta, vocab, ranked), fuse_unk=True,
                                       byte_fallback=True, dropout=None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


def _chat_templates(meta: dict[str, Any]) -> dict[str, str]:
    out = {}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        out["default"] = meta["tokenizer.chat_template"]
    for name in meta.get("tokenizer.chat_templates") or []:
        if isinstance(meta.get(f"tokenizer.chat_template.{name}"), str):
            out[name] = meta[f"tokenizer.chat_template.{name}"]
    return out
