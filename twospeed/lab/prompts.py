"""Synthetic but shaped prompts: the structure of real product traffic without any real text.

agent   a byte-stable shared prefix (system block + tool schemas) + new evidence; answer: one JSON tool call
rag     retrieved passages with ids ([P017] ...) + a question; answer: two sentences citing passage ids
chat    a short user message; answer: long free text
nightly a shared mapping instruction + one data row; answer: a small JSON object with an allowed code

Lengths are in tokens of the target model's tokenizer when one is given (`TokenCounter`), otherwise
estimated from words. Everything is drawn from a numpy Generator, so a seed fixes every byte; the run's
salt goes first in every prompt so no prefix cached by an earlier run can be hit.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from twospeed.builtin.task_corpus import CODES, TOOLS, WORDS  # the domain the task corpus writes in


class TokenCounter:
    """Counts tokens as the target bills them: with the target model's tokenizer (a checkpoint folder or GGUF file,
    with its chat template, or a bare tokenizer.json), else estimated at ~1.3 tokens a word.

    `count` is the raw text; `billed` is the whole prompt as the server counts it: a completion prompt with the
    tokenizer's special tokens (BOS), a chat with its template's wrapper. `truncate` cuts text to a number of
    tokens, which is how the lab makes every drawn length exact."""

    def __init__(self, tokenizer_path: str | Path | None = None):
        self.tokenizer = None  # the `tokenizers` backend
        self.model_tokenizer = None  # twospeed's Tokenizer: special tokens and chat template too
        if tokenizer_path is not None:
            from twospeed.model.checkpoint_files import find_gguf

            path = Path(tokenizer_path)
            file = path / "tokenizer.json" if path.is_dir() else path
            if not file.is_file() and find_gguf(path) is None:
                raise ValueError(f"--tokenizer {tokenizer_path}: no tokenizer.json or .gguf file there")
            from twospeed.lab.prefix_score import load_tokenizer

            self.model_tokenizer = load_tokenizer(str(path))
            self.tokenizer = self.model_tokenizer.backend
        sample = " ".join(WORDS * 4)
        self.tokens_per_word = self.count(sample) / len(sample.split()) if self.tokenizer else 1.3

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return max(1, round(len(text.split()) * 1.3)) if text else 0
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def billed(self, text: str = "", endpoint: str = "completions", messages: list[dict] | None = None) -> int:
        """Prompt tokens as the server bills them. A chat is `messages`, or `text` as one user message."""
        if self.model_tokenizer is None:
            return self.count(text if messages is None else "\n".join(str(m.get("content", "")) for m in messages))
        return len(self.prompt_ids(text, endpoint, messages))

    def prompt_ids(self, text: str = "", endpoint: str = "completions", messages: list[dict] | None = None) -> list[int]:
        """The prompt's token ids as the server computes them (what billed() counts): a completion with the
        tokenizer's special tokens, a chat through its template. Without the model's tokenizer, ids made from the
        words (estimated_ids), so prompts that share words share ids."""
        if self.model_tokenizer is None:
            return estimated_ids(text if messages is None else "\n".join(str(m.get("content", "")) for m in messages))
        if endpoint == "chat":
            rendered = self.render_chat(messages or [{"role": "user", "content": text}])
            if rendered is not None:
                return self.model_tokenizer.encode(rendered, add_special_tokens=False)
            text = "\n".join(str(m.get("content", "")) for m in messages) if messages else text
        return self.model_tokenizer.encode(text, add_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str | None:
        """The chat as the server's template renders it (None without a template)."""
        tok = self.model_tokenizer
        if tok is None or tok.chat_template is None:
            return None
        return tok.apply_chat_template(messages, add_generation_prompt=True)

    def ids(self, text: str) -> list[int]:
        """Token ids of the raw text (needs the tokenizer)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def truncate(self, text: str, tokens: int) -> str:
        """The first `tokens` tokens of `text` (all of it when shorter; estimated by words without a tokenizer)."""
        if self.tokenizer is None:
            return " ".join(text.split()[:self.words_for(tokens)])
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return text if len(ids) <= tokens else self.tokenizer.decode(ids[:tokens])

    def words_for(self, tokens: int) -> int:
        return max(1, round(tokens / self.tokens_per_word))


def estimated_ids(text: str) -> list[int]:
    """Stand-in token ids for a model without a tokenizer: each word a hashed id, and every ~third word a second
    one (~1.3 tokens a word, the lab's estimate), decided by position so that a shared prefix shares its ids."""
    ids = []
    for i, word in enumerate(text.split()):
        h = zlib.crc32(word.encode())
        ids.append(3 + h % 30000)
        if (i + 1) * 3 // 10 > i * 3 // 10:
            ids.append(3 + (h >> 15) % 30000)
    return ids


@dataclass(slots=True)
class Prompt:
    text: str
    meta: dict = field(default_factory=dict)  # what gates need: passage ids, allowed codes


def words(rng: np.random.Generator, counter: TokenCounter, tokens: int) -> str:
    """Filler of `tokens` tokens: exactly that many with a tokenizer (drawn long, then cut), else estimated.
    The words come from a child generator (one draw of `rng`), so a longer filler only appends words: the
    prompt around it draws the same, and its length in context grows by exactly what was asked."""
    if tokens <= 0:
        return ""
    child = np.random.default_rng(int(rng.integers(2**63)))
    n = counter.words_for(tokens)
    if not counter.exact:
        return " ".join(child.choice(WORDS, size=n).tolist())
    text = " ".join(child.choice(WORDS, size=n + n // 3 + 4).tolist())
    ids = counter.ids(text)
    while len(ids) < tokens:  # a word list that tokenizes short: draw more
        text += " " + " ".join(child.choice(WORDS, size=n // 2 + 4).tolist())
        ids = counter.ids(text)
    return text if len(ids) == tokens else counter.tokenizer.decode(ids[:tokens])


def agent_prefix(rng: np.random.Generator, counter: TokenCounter, tokens: int) -> str:
    """System block and tool schemas: the part a harness must keep byte-stable for the prefix cache. The
    schemas are a fixed cost; the system block fills the rest of `tokens`."""
    tools = [{"name": name, "description": f"{name.replace('_', ' ')} for the account in question",
              "parameters": {"type": "object", "properties": {"id": {"type": "string"}, "note": {"type": "string"}},
                             "required": ["id"]}} for name in TOOLS]
    schemas = f"\nTOOLS:\n{json.dumps(tools)}\n"
    head = "SYSTEM: You are an operations agent. Call exactly one tool per turn. "
    filler = max(0, tokens - counter.count(head + schemas))
    return head + words(rng, counter, filler) + schemas


def agent(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    text = (f"{prefix}TURN {turn} EVIDENCE: {words(rng, counter, new_tokens)}\n"
            'Reply with one JSON tool call {"tool": NAME, "arguments": {...}}:\n')
    return Prompt(text, {"tools": list(TOOLS)})


def rag(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    n = max(2, new_tokens // 180)
    ids = sorted({f"P{int(x):03d}" for x in rng.choice(999, size=n, replace=False)})
    per, extra = divmod(new_tokens, len(ids))  # the remainder spread over the first passages: any length fits
    if per < 4:
        per, extra = 4, 0
    passages = "\n".join(f"[{pid}] {words(rng, counter, per + (i < extra))}" for i, pid in enumerate(ids))
    text = (f"{prefix}RETRIEVED PASSAGES:\n{passages}\nQUESTION: {words(rng, counter, 16)}?\n"
            "Answer in two sentences and cite the passage ids you used, like [P012].\nANSWER:")
    return Prompt(text, {"passage_ids": ids})


def chat(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    return Prompt(f"{prefix}USER: Please draft a detailed note about {words(rng, counter, new_tokens)}\nASSISTANT:")


def nightly_prefix(rng: np.random.Generator, counter: TokenCounter, tokens: int) -> str:
    return (f"Map each row to a JSON object {{\"code\": CODE, \"confidence\": 0..1}} where CODE is one of "
            f"{', '.join(CODES)}. Guidance: {words(rng, counter, tokens)}\n")


def nightly(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    row = f"id={int(rng.integers(10**6))}, name={words(rng, counter, 4)}, notes={words(rng, counter, new_tokens)}"
    return Prompt(f"{prefix}ROW: {row}\nJSON:", {"allowed_codes": list(CODES)})


BUILDERS = {"agent": agent, "rag": rag, "chat": chat, "nightly": nightly}
PREFIXES = {"agent": agent_prefix, "nightly": nightly_prefix}


def shared_prefix(kind: str, rng: np.random.Generator, counter: TokenCounter, tokens: int) -> str:
    if tokens <= 0:
        return ""
    return PREFIXES.get(kind, lambda r, c, t: "CONTEXT: " + words(r, c, t) + "\n")(rng, counter, tokens)
