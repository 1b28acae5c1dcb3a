"""Speculative decoding's proposers, and the engine's side of it: who gets drafts, how many, and what they did.

A `Proposer` guesses up to gamma next tokens of each decoding request; the target checks them in the same
step's flat batch (a verify chunk: the decode token plus the drafts, a logits row each; scheduler.py, runner.py)
and the sampler keeps the longest prefix it would have drawn itself (sampler.py). Two proposers:

- `NgramProposer` (prompt lookup, no model): the request's last k tokens, k from prompt_lookup_max down to
  prompt_lookup_min, are looked up in its prompt and output so far; what followed their latest earlier occurrence
  is the draft (a continuation that runs into the draft itself is copied on, so a repeated run keeps repeating).
  An index per request maps each k-gram to where it last ended, grown by the new tokens only, so a lookup is a few
  dictionary probes whatever the length.
- `DraftModelProposer`: a smaller checkpoint with the same tokenizer, run in-process on the same device with its
  own paged KV cache (its own ModelRunner and KVCacheManager, prefix caching on, so an agent lane's shared prefix
  is prefilled once for the draft as for the target). It mirrors each request in a shadow sequence: on each step
  the shadow is synced with the request's tokens (its KV of a rejected draft is rolled back by counter, as the
  target's), catches up on new tokens (prompts within `draft_prefill_tokens` a step, over all requests), then
  proposes gamma tokens greedily, one batched forward pass per draft position. A greedy draft is a point mass,
  which is what the sampler's verification assumes.

`Speculator` is what the engine calls: before scheduling, `propose` asks the policy (spec_policy.py) how many
drafts each decoding request gets, asks the proposer, and trims the drafts to the request's room (max_model_len,
max_tokens) and to what its grammar accepts; after sampling, `record` books a request's verify step in its trace,
its bill and the policy. The time `propose` took is the step's proposer time (the cost model learns the step
without it; the policy's cost ratio includes it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from twospeed.config import SpecConfig
from twospeed.engine.cost_model import StepCostModel, StepShape
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.engine.lazy_pool import LazyBlockPool
from twospeed.engine.request import Request
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.scheduler import ScheduledChunk, in_decode
from twospeed.engine.spec_policy import MeasuredSteps, SpecPolicy


class Proposer(Protocol):
    """Guesses the next tokens of requests; keeps whatever per-request state it needs until `release`."""

    name: str

    def propose(self, requests: list[Request], gammas: list[int]) -> list[list[int]]:
        """Up to gammas[i] draft tokens for requests[i], to follow its all_token_ids (fewer or none is fine)."""
        ...

    def release(self, request_id: str) -> None:
        """The request is gone: drop its state (and any KV blocks)."""
        ...


# -- n-gram prompt lookup ---------------------------------------------------------------------------------
class _Lookup:
    """For k in [lo, hi]: each k-gram of one request's tokens -> the position right after its latest occurrence,
    over the occurrences ending before the last token (so the suffix never finds itself)."""

    def __init__(self, lo: int, hi: int):
        self.maps: dict[int, dict[tuple[int, ...], int]] = {k: {} for k in range(lo, hi + 1)}
        self.indexed = 0  # ends [0, indexed) are in the maps

    def draft(self, tokens: list[int], gamma: int) -> list[int]:
        n = len(tokens)
        for end in range(self.indexed, n):  # the grams ending at the new positions (not the last: it is the query)
            for k, m in self.maps.items():
                if end >= k:
                    m[tuple(tokens[end - k:end])] = end
        self.indexed = max(self.indexed, n)
        for k in sorted(self.maps, reverse=True):  # the longest suffix first
            if n <= k:
                continue
            at = self.maps[k].get(tuple(tokens[n - k:]))
            if at is not None:
                seq = tokens + []
                for j in range(gamma):  # copy what followed; a copy that reaches the end runs on into itself
                    seq.append(seq[at + j])
                return seq[n:]
        return []


class NgramProposer:
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self._lookups: dict[str, _Lookup] = {}

    def propose(self, requests: list[Request], gammas: list[int]) -> list[list[int]]:
        out = []
        for req, gamma in zip(requests, gammas):
            lookup = self._lookups.get(req.request_id)
            if lookup is None:
                lookup = self._lookups[req.request_id] = _Lookup(self.lo, self.hi)
            out.append(lookup.draft(req.all_token_ids, gamma) if gamma > 0 else [])
        return out

    def release(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)


# -- a draft model ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Shadow:
    seq: Request  # the draft's copy of the request's tokens (+ its own drafts); num_computed_tokens = its KV
    synced: int = 0  # positions known equal to the request's tokens


class DraftModelProposer:
    name = "draft"

    def __init__(self, path: Path, target_vocab: int, *, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 block_size: int, max_len: int, prefill_tokens: int, linear_backend: str = "auto",
                 attention_backend: str = "auto"):
        from twospeed.engine.runner import ModelRunner
        from twospeed.model.loader import load_model, load_model_config

        cfg = load_model_config(path)
        if cfg.vocab_size != target_vocab:
            raise ValueError(f"draft model {path}: vocabulary of {cfg.vocab_size} tokens, the target's has "
                             f"{target_vocab}; a draft needs the target's tokenizer")
        self.model = load_model(path, dtype, device, max_positions=max_len, linear_backend=linear_backend,
                                attention_backend=attention_backend)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=True, pool=LazyBlockPool(num_blocks, True))
        self.runner = ModelRunner(self.model, num_blocks, block_size, device, dtype)
        self.prefill_tokens = prefill_tokens
        self._shadows: dict[str, _Shadow] = {}

    def propose(self, requests: list[Request], gammas: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        budget = self.prefill_tokens
        chunks, want = [], {}  # the catch-up pass; shadow request id -> (index, gamma)
        for i, (req, gamma) in enumerate(zip(requests, gammas)):
            if gamma <= 0:
                continue
            sh = self._sync(req)
            start, todo = sh.seq.num_computed_tokens, req.num_tokens - sh.seq.num_computed_tokens
            n = todo if todo <= 1 + gamma else min(todo, budget)  # steady state (a few new tokens) always fits
            if n <= 0 or not self.kv.allocate_slots(req.request_id, start + n + (gamma - 1 if n == todo else 0)):
                continue
            budget -= n if todo > 1 + gamma else 0
            chunks.append(ScheduledChunk(sh.seq, start, n))
            if n == todo:
                want[req.request_id] = (i, gamma)
        while chunks:
            logits, sampling, _ = self.runner.execute(chunks, self.kv)
            for c in chunks:
                c.request.num_computed_tokens = c.start + c.num_tokens
                self.kv.cache_full_blocks(c.request.request_id, c.request.all_token_ids,
                                          min(c.request.num_computed_tokens, self._shadows[c.request.request_id].synced))
            chunks = []
            for c, token in zip(sampling, logits.argmax(dim=-1).tolist()):  # greedy: a point-mass draft
                i, gamma = want[c.request.request_id]
                c.request.all_token_ids.append(token)
                out[i].append(token)
                if len(out[i]) < gamma:
                    chunks.append(ScheduledChunk(c.request, c.request.num_tokens - 1, 1))
        return out

    def _sync(self, req: Request) -> _Shadow:
        """The request's shadow with its tokens: the shadow's own drafts past the first difference dropped, its KV
        counter rolled back to the common prefix (a fresh shadow starts at its prefix-cache hit)."""
        rid = req.request_id
        sh = self._shadows.get(rid)
        if sh is None:
            seq = Request(rid, list(req.all_token_ids), SamplingParams(max_tokens=1), max_output_tokens=1)
            cached = self.kv.find_cached_prefix(seq.all_token_ids)
            if self.kv.allocate_slots(rid, len(cached) * self.kv.block_size, cached):
                seq.num_computed_tokens = len(cached) * self.kv.block_size
            sh = self._shadows[rid] = _Shadow(seq, len(seq.all_token_ids))
        ours, theirs = sh.seq.all_token_ids, req.all_token_ids
        same, m = sh.synced, min(len(ours), len(theirs))
        while same < m and ours[same] == theirs[same]:
            same += 1
        del ours[same:]
        ours += theirs[same:]
        sh.synced = len(theirs)
        sh.seq.num_computed_tokens = min(sh.seq.num_computed_tokens, same)
        return sh

    def release(self, request_id: str) -> None:
        if self._shadows.pop(request_id, None) is not None:
            self.kv.free(request_id)


def draft_model_path(name: str) -> Path:
    """The draft's checkpoint folder: as the target's is found (engine.py imports this module, hence here)."""
    from twospeed.builtin.registry import resolve_model_path

    return resolve_model_path(name)


# -- the engine's side ------------------------------------------------------------------------------------
class Speculator:
    """Drafts for the decoding requests before each step; their verify steps booked after it."""

    def __init__(self, cfg: SpecConfig, proposer: Proposer, max_model_len: int):
        self.cfg = cfg
        self.proposer = proposer
        self.policy = SpecPolicy(cfg)
        self.measured = MeasuredSteps()
        self.max_model_len = max_model_len
        self.propose_seconds = 0.0  # the last propose call's time
        self._asked: dict[str, Request] = {}  # requests the proposer may hold state for, by id

    def start(self, req: Request, off: str | None = None) -> None:
        """A new request (off: "opted_out" or "lane_policy", which keep it from ever speculating)."""
        self.policy.start(req, off)

    def propose(self, running: list[Request], live: Callable[[str], Request | None]) -> float:
        """Set spec_token_ids of every decoding request the policy lets propose; returns the seconds it took.
        live(request_id): the scheduler's request of that id, if any. A proposer's state of a request that has
        ended is released, also where a new request has taken its id since."""
        t0 = time.perf_counter()
        for rid in [rid for rid, req in self._asked.items() if live(rid) is not req]:
            self.proposer.release(rid)
            del self._asked[rid]
        reqs, gammas = [], []
        for req in running:
            req.spec_token_ids = []
            if req.spec_state is None or not in_decode(req):
                continue
            room = min(self.max_model_len - req.num_tokens, req.max_output_tokens - len(req.output_token_ids) - 1)
            gamma = min(self.policy.gamma(req), room)
            if gamma > 0:
                reqs.append(req)
                gammas.append(gamma)
        if reqs:
            self._asked.update((r.request_id, r) for r in reqs)
            for req, gamma, draft in zip(reqs, gammas, self.proposer.propose(reqs, gammas)):
                draft = draft[:gamma]
                if req.grammar is not None and draft:  # a draft the grammar forbids would only be rejected
                    req.grammar.sync(req.output_token_ids)
                    draft = draft[:req.grammar.valid_prefix(draft)]
                req.spec_token_ids = draft
        self.propose_seconds = time.perf_counter() - t0
        return self.propose_seconds

    def cost_ratio(self, shape: StepShape, model: StepCostModel) -> float:
        """rho - 1 of the step just run: (its time + the proposer's) over its plain twin's, less one; the times
        as measured for this shape where the engine has run both (MeasuredSteps), else as the cost model predicts."""
        if not shape.draft_tokens:
            return 0.0
        measured = None if shape.prefill_tokens else self.measured.times(shape.decode_tokens, shape.draft_tokens)
        verify, plain = measured or (model.predict(shape), model.predict(shape.without_drafts()))
        if plain <= 0:
            return 0.0
        return max(0.0, (verify + self.propose_seconds - plain) / plain)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """The engine's measured time of a step (the proposer's excluded)."""
        self.measured.observe(shape.prefill_tokens, shape.decode_tokens, shape.draft_tokens, seconds)

    def record(self, req: Request, num_draft: int, accepted: int, kept: int, step_extra: float) -> None:
        """req verified num_draft drafts; the sampler accepted `accepted`, of which `kept` stayed in the output (a
        stop may cut the rest); step_extra: the step's cost_ratio."""
        if num_draft <= 0:
            return
        req.spec.record(num_draft, kept)
        req.bill.spec_proposed += num_draft
        req.bill.spec_accepted += kept
        req.bill.spec_rejected += num_draft - kept
        self.policy.observe(req, num_draft, accepted, step_extra / num_draft)


def make_speculator(cfg: SpecConfig, *, target_vocab: int, max_model_len: int, dtype: torch.dtype,
                    device: torch.device, num_blocks: int, block_size: int, linear_backend: str,
                    attention_backend: str) -> Speculator | None:
    """The engine's Speculator for cfg (None when speculation is off)."""
    if not cfg.enabled:
        return None
    if cfg.method == "ngram":
        proposer: Proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    else:
        proposer = DraftModelProposer(draft_model_path(cfg.draft_model), target_vocab, dtype=dtype, device=device,
                                      num_blocks=num_blocks, block_size=block_size, max_len=max_model_len,
                                      prefill_tokens=cfg.draft_prefill_tokens, linear_backend=linear_backend,
                                      attention_backend=attention_backend)
    return Speculator(cfg, proposer, max_model_len)
