"""Constrained decoding: compile a request's StructuredOutput with llguidance, mask its logits,
follow its grammar token by token, and say when the document is complete or a token is forced.

Inputs: the engine's tokenizer (its `tokenizers` JSON is handed to llguidance's own tokenizer
bridge, so token bytes are the model's), the model's vocabulary size and EOS ids, and each
request's StructuredOutput. Outputs: a GrammarState per constrained request, whose `allowed()`
is a bool mask over the vocabulary for the next token.

Why llguidance (not xgrammar): a small self-contained wheel (no triton), masks computed on the
CPU lazily per step in well under a millisecond for an 8k vocabulary, and broad JSON Schema
coverage (see README "Structured output").

Jump-forward is exact: a token is appended without a forward pass of its own only when the
grammar's mask allows that one token and nothing else (not EOS either), so any sampler, greedy
or not, would have picked it; its KV is computed in the next step, together with the next
sample. Bytes the grammar forces but that several tokenizations could spell are left to the
model, so jump-forward never changes which tokens a greedy request emits.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import llguidance as llg
import numpy as np

from twospeed.engine.json_schema import SchemaProblem, check_schema
from twospeed.engine.sampling_params import InvalidParam, StructuredOutput

_GBNF_FIRST_RULE = re.compile(r"\s*(?:#[^\n]*\n\s*)*[A-Za-z][\w-]*\s*::=")

# Compact JSON unless the schema's "x-guidance" says otherwise: no optional whitespace to ramble in.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def warm_grammars(engine) -> None:
    """Build an engine's (or an EngineView's) grammar compiler now, where it has a tokenizer. A server does this
    before it says ready: built on first use, llguidance's tokenizer (~170 ms for a 32k vocabulary) was made while
    the first structured request arrived, in the engine's loop (every stream waited) and in the API process (a
    core taken from a two-thread step: one step of a ~12 ms decode took 470 ms)."""
    if engine.tokenizer is not None:
        engine.grammars  # noqa: B018 (the property builds it)


def grammar_compiler(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> "GrammarCompiler":
    """The compiler an engine (or a server checking requests for one) builds over its tokenizer."""
    if tokenizer is None:
        raise InvalidParam("structured", "structured output needs a tokenizer (the engine was started with "
                                         "skip_tokenizer_init)")
    return GrammarCompiler(tokenizer.backend.to_str(), vocab_size, eos_token_ids)


class GrammarCompiler:
    """One per engine: the llguidance tokenizer and compiled grammars cached by content (LRU).

    A cached entry is a matcher that never consumed a token; each request gets a deep copy, which
    costs microseconds where compiling a schema costs milliseconds. Thread-safe: the server compiles in
    worker threads ahead of admission, so the engine thread finds the grammar cached.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 256):
        eos = sorted(eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = vocab_size
        self.ll_tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def grammar_text(self, spec: StructuredOutput) -> str:
        """The llguidance grammar of a spec; raises ValueError for an invalid JSON schema."""
        kind = spec.kind
        if kind == "json":
            try:
                check_schema(spec.json)  # cached: the server checked this very schema already
            except SchemaProblem as e:
                where = "/".join(str(p) for p in e.path) or "(root)"
                raise InvalidParam("structured",
                                   f"invalid JSON schema at {where}: {e.detail or 'it ' + e.reason}") from None
            return llg.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llg.grammar_from("choice", spec.choice)
        # Lark (llguidance's own dialect) unless the first rule is written GBNF's way ("root ::= ...").
        fmt = "gbnf" if _GBNF_FIRST_RULE.match(spec.grammar) else "lark"
        try:
            return llg.grammar_from(fmt, spec.grammar)
        except ValueError as e:
            raise InvalidParam("structured", f"invalid grammar: {e}") from None

    def compile(self, spec: StructuredOutput) -> llg.LLMatcher:
        """A fresh matcher for spec (from the cache when its content was compiled before)."""
        key = spec.key()
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return proto.deep_copy()
            self.misses += 1
        try:
            grammar = self.grammar_text(spec)
        except InvalidParam:
            raise
        except Exception as e:  # whatever else the schema or grammar text makes the library raise
            raise InvalidParam("structured", f"structured output ({spec.kind}) cannot be compiled: {e}") from None
        try:
            proto = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        except Exception as e:  # llguidance raises for some malformed grammars instead of an error state
            raise InvalidParam("structured", f"structured output ({spec.kind}) cannot be compiled: {e}") from None
        if proto.is_error():
            raise InvalidParam("structured",
                               f"structured output ({spec.kind}) cannot be compiled: {proto.get_error().strip()}")
        if spec.kind in ("json", "json_object") and proto.is_stopped():
            # Nothing but the empty text matches, and the empty text is no JSON document.
            raise InvalidParam("structured",
                               "structured output (json): invalid JSON schema at (root): it admits no document")
        with self._lock:
            self._cache[key] = proto
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(spec, self.compile(spec), self.vocab_size, self.eos_token_ids)


class GrammarState:
    """One request's position in its grammar, mirroring exactly the output tokens it emitted."""

    def __init__(self, spec: StructuredOutput, matcher: llg.LLMatcher, vocab_size: int,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0  # output tokens the matcher has consumed
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._allowed: np.ndarray | None = None  # mask for position num_consumed, computed on demand

    def allowed(self) -> np.ndarray:
        """bool [vocab_size]: the tokens the grammar allows next (EOS only once the document may end)."""
        if self._allowed is None:
            self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")  # bit t = token t
            self._allowed = bits[: self.vocab_size].astype(bool)
        return self._allowed

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token. False when the matcher is in an error state (a parser limit hit
        mid-document leaves it one, with an empty mask): the engine ends that request alone."""
        ok = self.matcher.consume_token(token_id)
        self.num_consumed += 1
        self._allowed = None
        return ok

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state that of these output tokens: replay them into a reset matcher when
        their count differs from what it consumed (a no-op otherwise).

        The engine preempts by recompute and keeps the tokens, so this only replays when some
        caller changed the tokens behind the matcher's back."""
        if self.num_consumed == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_consumed = 0
        self._allowed = None
        for t in output_token_ids:
            if not self.accept(t):
                break

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of these tokens (draft tokens, say) the grammar would accept from here, one after another."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def draft_masks(self, drafts: Sequence[int]) -> list[np.ndarray]:
        """len(drafts) + 1 masks: the tokens allowed after drafts [:j], for j = 0 .. len(drafts). The matcher is
        advanced through the drafts it accepts and rolled back, so its state is unchanged afterwards. Masks past a
        draft it forbids repeat the last one (those rows are never used: that draft is rejected)."""
        masks = [self.allowed()]
        consumed = 0
        for t in drafts[:self.valid_prefix(drafts)]:
            if not self.matcher.consume_token(t):
                break
            consumed += 1
            self._allowed = None
            masks.append(self.allowed())
        if consumed:
            self.matcher.rollback(consumed)
        self._allowed = masks[0]
        masks += [masks[-1]] * (len(drafts) + 1 - len(masks))
        return masks

    @property
    def is_complete(self) -> bool:
        """The document is finished: nothing but EOS may follow, so generation stops here."""
        return self.matcher.is_stopped()

    def forced_token(self) -> int | None:
        """The only token the grammar allows next, if exactly one (and it is not EOS), else None."""
        if not self.spec.jump_forward or self.is_complete:
            return None
        allowed = self.allowed()
        # Cheap test first: more than one set word means more than one token.
        if np.count_nonzero(self._words) != 1 or int(np.bitwise_count(self._words).sum()) != 1:
            return None
        token = int(np.flatnonzero(allowed)[0])
        return None if token in self.eos_token_ids else token
