"""Prefix-stability scorer: how much of each prompt a prefix cache would serve, and what breaks it.

A harness (an agent loop, a RAG pipeline) sends a sequence of prompts. A prefix cache only
helps while each prompt starts with bytes -- and then tokens, in whole KV blocks -- that an
earlier prompt already had; a timestamp in the system prompt or tool schemas in a different
order throws the rest away. For each prompt this reports, against every earlier prompt (a
prefix cache holds them all):
  - the byte-stable prefix: the longest common byte prefix with any earlier prompt;
  - the token-stable prefix: the same over token ids (tokenization can end it sooner);
  - cached tokens: what twospeed's prefix cache would hit, block aligned exactly as
    engine/kv_cache.py hashes full blocks (same hash chain; at most (len - 1) // block_size
    blocks, since the last prompt token is always computed);
  - the first differing span against the closest earlier prompt, with a little context.

Input: JSONL, one object per line with "prompt" (a string, encoded with special tokens as
the engine encodes a completion prompt) or "messages" (a chat, rendered with the tokenizer's
chat template and encoded without special tokens, as the server does; optional "tools").
The prediction assumes an unbounded cache (nothing evicted) and counts only prompts' own
blocks: a prompt that repeats an earlier *answer* may hit more in a real server.
"""

from __future__ import annotations

import bisect
import difflib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from twospeed.engine.kv_cache import BlockHash, hash_block_tokens
from twospeed.model.tokenizer import Tokenizer

CONTEXT_CHARS = 24  # characters of common text shown before a difference
SPAN_CHARS = 48  # characters shown of each side of a difference


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """One line of the input: its text as sent and its token ids."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a prompt first departs from its closest earlier prompt."""

    char_offset: int  # first differing character
    context: str  # common text just before it
    before: str  # the earlier prompt's text from there (up to where the two agree again)
    after: str  # this prompt's text from there


@dataclass(frozen=True, slots=True)
class PromptScore:
    index: int  # 0-based line of the input
    prompt_bytes: int
    prompt_tokens: int
    byte_stable: int  # longest common byte prefix with any earlier prompt
    token_stable: int  # longest common token prefix with any earlier prompt
    cached_tokens: int  # predicted prefix-cache hit, whole blocks
    closest: int | None  # index of the earlier prompt sharing the longest byte prefix
    extends_closest: bool  # the closest earlier prompt is a prefix of this one (append-only)
    divergence: Divergence | None  # None for the first prompt and for append-only ones

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PrefixReport:
    block_size: int
    prompts: list[PromptScore]

    @property
    def prompt_tokens(self) -> int:
        return sum(p.prompt_tokens for p in self.prompts)

    @property
    def cached_tokens(self) -> int:
        return sum(p.cached_tokens for p in self.prompts)

    @property
    def hit_rate(self) -> float:
        """Predicted prefix-cache hit rate: cached tokens / prompt tokens over the whole sequence."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {"block_size": self.block_size,
                "summary": {"prompts": len(self.prompts), "prompt_tokens": self.prompt_tokens,
                            "cached_tokens": self.cached_tokens, "hit_rate": self.hit_rate},
                "prompts": [{**asdict(p), "hit_rate": p.hit_rate} for p in self.prompts]}


# -- input ------------------------------------------------------------------------------------------
def load_tokenizer(path: str | None = None) -> Tokenizer:
    """A built-in model's tokenizer (default: the demo's), an HF checkpoint folder's, a GGUF file's, or a bare
    tokenizer.json (no chat template)."""
    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin
    from twospeed.model.checkpoint_files import find_gguf

    if path is None or is_builtin(str(path)):
        return Tokenizer.from_pretrained(builtin_checkpoint_path(str(path or "demo")))
    p = Path(path)
    if p.is_dir() or find_gguf(p) is not None:
        return Tokenizer.from_pretrained(p)
    if p.is_file():
        import tokenizers
        try:
            return Tokenizer(tokenizers.Tokenizer.from_file(str(p)))
        except Exception as e:  # the Rust error names no file
            raise ValueError(f"cannot read {p} as a tokenizer.json: {e}") from e
    raise ValueError(f"tokenizer {path!r}: no such folder or tokenizer.json file")


def render(record: dict, tokenizer: Tokenizer) -> RenderedPrompt:
    """The prompt text and ids the engine would see for one input record."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object with 'prompt' or 'messages', got {type(record).__name__}")
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str):
            raise ValueError("'prompt' must be a string")
        return RenderedPrompt(text, tokenizer.encode(text, add_special_tokens=True))
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError("expected 'prompt' (a string) or 'messages' (a list of chat messages)")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' must be a list")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return RenderedPrompt(text, tokenizer.encode(text, add_special_tokens=False))


def read_prompts(path: str | Path, tokenizer: Tokenizer) -> list[RenderedPrompt]:
    """Render every non-blank line of a JSONL file; errors name the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(render(json.loads(line), tokenizer))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
            except Exception as e:  # a template error, a bad field
                raise ValueError(f"{path}:{lineno}: {e}") from e
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# -- scoring ----------------------------------------------------------------------------------------
def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix; binary search over slice equality (compared in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _LongestPrefixIndex:
    """The longest common prefix of a query with any inserted sequence.

    In sorted order, the sequence sharing the longest prefix with a query is one of its two
    neighbours, so a bisect finds it without comparing against every earlier prompt.
    """

    def __init__(self) -> None:
        self._keys: list = []
        self._ids: list[int] = []

    def best(self, key: Sequence) -> tuple[int, int | None]:
        """(common prefix length, id of the sequence that has it); (0, None) when empty."""
        i = bisect.bisect_left(self._keys, key)
        best_len, best_id = 0, None
        for j in (i - 1, i):
            if 0 <= j < len(self._keys):
                n = common_prefix_len(key, self._keys[j])
                if n > best_len or (n == best_len and best_id is not None and self._ids[j] > best_id):
                    best_len, best_id = n, self._ids[j]
        return best_len, best_id

    def add(self, key: Sequence, ident: int) -> None:
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._ids.insert(i, ident)


class _BlockCache:
    """The prefix cache's hash chain without a pool: what `KVCacheManager.find_cached_prefix` would find
    if nothing were ever evicted."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: set[BlockHash] = set()

    def lookup_and_insert(self, token_ids: Sequence[int]) -> int:
        """Cached tokens for this prompt, then register its full blocks (as its prefill would)."""
        bs, hits, parent = self.block_size, 0, None
        chain = []
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            chain.append(parent)
        for i in range((len(token_ids) - 1) // bs):  # the last prompt token is always computed
            if chain[i] not in self._hashes:
                break
            hits += bs
        self._hashes.update(chain)
        return hits


def first_difference(old: str, new: str, start: int) -> Divergence:
    """The differing span of two texts that agree up to `start`: from there up to where they agree again."""
    a, b = old[start:start + 4 * SPAN_CHARS], new[start:start + 4 * SPAN_CHARS]
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    # The first matching run of a few characters ends the span ("10:31" vs "10:32" stops at ":")
    end_a, end_b = len(a), len(b)
    for m in matcher.get_matching_blocks():
        if m.size >= 4 or m.size == 0:  # size 0 is the sentinel at the ends
            end_a, end_b = m.a, m.b
            break
    return Divergence(start, old[max(0, start - CONTEXT_CHARS):start], _clip(a[:end_a]), _clip(b[:end_b]))


def _clip(s: str) -> str:
    return s if len(s) <= SPAN_CHARS else s[:SPAN_CHARS - 1] + "…"


def score_prompts(prompts: Sequence[RenderedPrompt], block_size: int = 16) -> PrefixReport:
    """Score each prompt against all earlier ones (see the module docstring)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    by_bytes, by_tokens = _LongestPrefixIndex(), _LongestPrefixIndex()
    cache = _BlockCache(block_size)
    scores = []
    for i, p in enumerate(prompts):
        data = p.text.encode("utf-8")
        ids = tuple(p.token_ids)
        byte_stable, closest = by_bytes.best(data)
        token_stable, _ = by_tokens.best(ids)
        cached = cache.lookup_and_insert(ids)
        extends = closest is not None and byte_stable == len(prompts[closest].text.encode("utf-8"))
        divergence = None
        if closest is not None and not extends:
            old = prompts[closest].text
            # A byte prefix may end inside a multi-byte character: back off to a whole character.
            start = len(data[:byte_stable].decode("utf-8", errors="ignore"))
            divergence = first_difference(old, p.text, start)
        scores.append(PromptScore(i, len(data), len(ids), byte_stable, token_stable, cached, closest, extends,
                                  divergence))
        by_bytes.add(data, i)
        by_tokens.add(ids, i)
    return PrefixReport(block_size, scores)


def lane_check(prompts: Sequence[RenderedPrompt], prefixes: Sequence[str], block_size: int = 16) -> dict:
    """What a bench lane's prompts, in send order, say about its shared prefix: the predicted cache hit rate,
    and where prompts that start with the lane's shared prefix (`prefixes[i]`, "" for none) already differ
    inside it -- the first unstable span (the earliest such divergence), a timestamp or a reordered list."""
    report = score_prompts(prompts, block_size)
    declared, unstable = 0, []
    for p, score, prefix in zip(prompts, report.prompts, prefixes):
        if not prefix:
            continue
        declared += 1
        start = p.text.find(prefix)
        d = score.divergence
        if d is not None and start >= 0 and d.char_offset < start + len(prefix):
            unstable.append((d.char_offset, score.index, d))
    first = min(unstable, key=lambda u: (u[0], u[1])) if unstable else None
    return {"prompts": len(prompts), "block_size": block_size, "prompt_tokens": report.prompt_tokens,
            "predicted_cached_tokens": report.cached_tokens, "predicted_hit_rate": report.hit_rate,
            "declared_prefix_prompts": declared, "unstable_prompts": len(unstable),
            "first_unstable": None if first is None else {"prompt": first[1], **asdict(first[2])}}


# -- output -----------------------------------------------------------------------------------------
def print_report(report: PrefixReport, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title=f"prefix stability (block size {report.block_size})", show_edge=False)
    for col in ("#", "tokens", "byte-stable", "token-stable", "cached", "hit", "vs #", "first difference"):
        table.add_column(col, justify="left" if col == "first difference" else "right",
                         overflow="fold" if col == "first difference" else "ellipsis")
    for p in report.prompts:
        if p.closest is None:
            diff = Text("first prompt", style="dim")
        elif p.divergence is None:
            diff = Text("extends it (append-only)", style="green")
        else:
            d = p.divergence
            diff = Text.assemble((f"@{d.char_offset}: ", "dim"), (repr(d.context)[1:-1], "dim"),
                                 (f"[{repr(d.before)[1:-1]}]", "red"), " → ", (f"[{repr(d.after)[1:-1]}]", "green"))
        table.add_row(str(p.index), f"{p.prompt_tokens:,}", f"{p.byte_stable:,} B", f"{p.token_stable:,}",
                      f"{p.cached_tokens:,}", f"{p.hit_rate:.0%}", "" if p.closest is None else str(p.closest), diff)
    console.print(table)
    console.print(f"{len(report.prompts)} prompts, {report.prompt_tokens:,} prompt tokens, "
                  f"{report.cached_tokens:,} predicted cached: hit rate {report.hit_rate:.1%} "
                  f"(an unbounded cache; prompts' own blocks only)")


def run(path: str, tokenizer: str | None = None, block_size: int = 16, as_json: bool = False) -> int:
    """`twospeed prefix-score`: 0 on success, 2 on bad input (the message says why)."""
    try:
        prompts = read_prompts(path, load_tokenizer(tokenizer))
        report = score_prompts(prompts, block_size)
    except (ValueError, OSError) as e:
        print(f"twospeed prefix-score: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
        return 0
    from rich.console import Console

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)  # a log file or a pipe: don't fold the spans into 80 columns
    print_report(report, console)
    return 0
