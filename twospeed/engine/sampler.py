"""Turn a step's logits into tokens, each row under its own request's parameters; verify draft tokens.

Filters run batched over the rows that need them (temperature, top-k, top-p,
min-p); randomness is per request: a request with a seed owns a
torch.Generator, so its tokens do not depend on what else is in the batch or
on preemption (the generator lives on the request, not on its KV). Sampling
uses the exponential race (argmax of p / Exp(1) noise), which draws exactly
from p and needs one noise vector per row. Logprobs are those of the raw model
distribution, before any filter or grammar mask, as vLLM reports them. A row's logits are first adjusted by its
request's logit_bias, then its penalties (repetition over prompt and output, as vLLM and HF define it; frequency and
presence over the output, as OpenAI does), on that row alone. A constrained request's row is then masked to the
tokens its grammar allows (structured.py) before any filter.

Verification (speculative decoding): a request with k draft tokens has k + 1
rows, row j the target's logits after its drafts [:j], each masked as the
position it stands for (min_tokens and the penalties count the drafts before it, the grammar is
advanced through them). Walking j = 0, 1, ...: row j's token is drawn exactly
as a plain step would draw it at that position (greedy: the argmax; sampled:
the race with that position's own noise); if it is the draft, the draft is
kept and the walk goes on, else that token ends the walk (after k kept
drafts, row k's token does). This is rejection sampling for a draft that is
a point mass (prompt lookup, a greedy draft model), as in Leviathan et al. and
Chen et al.: draft d is kept with probability min(1, p(d) / q(d)) = p(d), and a
rejected step's token is distributed as the residual max(0, p - q) normalised,
p with d taken out: the race's winner given that it is not d. So greedy output
is token-identical to plain decoding, and a seeded request draws its noise
vectors one per emitted token in the same order, so its tokens are identical
too. Unseeded rows draw all their noise at once (unused rows' draws wasted).
"""

from __future__ import annotations

import numpy as np
import torch

from twospeed.engine.request import Logprob, Request


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[Logprob | None]]:
        """logits: [N, vocab] float32, row i for requests[i] -> one token id and optional logprobs per row."""
        raw = logits
        logits = self._adjust(logits, requests)
        logits = self._mask_early_stops(logits, requests)
        logits = self._mask_grammars(logits, requests)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            tokens[rows] = self._sample(logits[rows], [requests[i] for i in rows])
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, requests, token_list)

    def verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
               ) -> tuple[list[list[int]], list[list[Logprob | None]]]:
        """logits: [sum(1 + len(d) for d in drafts), vocab], request i's 1 + len(drafts[i]) rows one after another.
        Returns, per request, the tokens it emits (the drafts it kept, then one more) and their logprobs."""
        if not any(drafts):
            tokens, lps = self(logits, requests)
            return [[t] for t in tokens], [[lp] for lp in lps]
        rows = [r for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
        ahead = [j for d in drafts for j in range(len(d) + 1)]
        raw = logits
        logits = self._adjust(logits, rows, [d[:j] for d in drafts for j in range(len(d) + 1)])
        logits = self._mask_early_stops(logits, rows, ahead)
        logits = self._mask_grammars(logits, rows, _draft_masks(requests, drafts))
        greedy = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = dict(zip(sampled, self.filtered_probs(logits[sampled], [rows[i] for i in sampled]))) if sampled else {}
        noise = self._unseeded_noise([i for i in sampled if rows[i].generator is None], logits.shape[-1])
        out_tokens, out_rows, first = [], [], 0
        for req, draft in zip(requests, drafts):
            emitted = []
            for j in range(len(draft) + 1):
                i = first + j
                if i in probs:  # the race with this position's own noise: exactly p, as a plain step draws it
                    e = noise[i] if req.generator is None else _exponential(
                        torch.rand(logits.shape[-1], device=logits.device, generator=req.generator))
                    token = int((probs[i] / e).argmax())
                else:
                    token = greedy[i]
                emitted.append(token)
                if j == len(draft) or token != draft[j]:
                    break
            out_tokens.append(emitted)
            out_rows.append(range(first, first + len(emitted)))
            first += len(draft) + 1
        flat_rows = [i for r in out_rows for i in r]
        flat_lps = self._logprobs(raw[flat_rows] if flat_rows else raw[:0], [rows[i] for i in flat_rows],
                                  [t for ts in out_tokens for t in ts])
        lps, k = [], 0
        for ts in out_tokens:
            lps.append(flat_lps[k:k + len(ts)])
            k += len(ts)
        return out_tokens, lps

    @staticmethod
    def score(logits: torch.Tensor, token_ids: list[int], n: int) -> list[Logprob]:
        """Row i's logprob of token_ids[i], its rank and the top n: prompt logprobs, from the raw logits."""
        lp = torch.log_softmax(logits, dim=-1)
        return [_logprob(lp[i], t, n) for i, t in enumerate(token_ids)]

    def _logprobs(self, raw: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[Logprob | None]:
        want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        logprobs: list[Logprob | None] = [None] * len(requests)
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            for j, i in enumerate(want):
                logprobs[i] = _logprob(lp[j], tokens[i], requests[i].params.logprobs)
        return logprobs

    @staticmethod
    def _adjust(logits: torch.Tensor, requests: list[Request], before: list[list[int]] | None = None) -> torch.Tensor:
        """logit_bias, then the penalties, on the rows whose request asks for them. before[i]: tokens row i stands
        after (its drafts before it), counted as output."""
        rows = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
        if not rows:
            return logits
        logits = logits.clone()
        vocab, dev = logits.shape[-1], logits.device
        for i in rows:
            r, row = requests[i], logits[i]
            p = r.params
            output = r.output_token_ids + before[i] if before else r.output_token_ids
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
                row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev)
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
                seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=dev)] = True
                if output:
                    seen[torch.tensor(output, dtype=torch.long, device=dev)] = True
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalized, row))
            if output and (p.frequency_penalty or p.presence_penalty):
                counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=dev), minlength=vocab)[:vocab]
                row -= counts.to(row.dtype) * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, requests: list[Request],
                          ahead: list[int] | None = None) -> torch.Tensor:
        """Below min_tokens, EOS and stop_token_ids may not be chosen. ahead[i]: tokens row i stands after (its
        drafts before it), counted as emitted."""
        rows, cols = [], []
        for i, r in enumerate(requests):
            if len(r.output_token_ids) + (ahead[i] if ahead else 0) < r.params.min_tokens:
                banned = set(r.eos_token_ids) | set(r.params.stop_token_ids)
                rows += [i] * len(banned)
                cols += sorted(banned)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _mask_grammars(self, logits: torch.Tensor, requests: list[Request],
                       masks: dict[int, np.ndarray] | None = None) -> torch.Tensor:
        """Rows of constrained requests keep only the tokens their grammar allows; other rows are untouched.
        masks: row -> allowed mask, given for verify rows (the grammar advanced through the drafts before them)."""
        if masks is None:
            masks = {}
            for i, r in enumerate(requests):
                if r.grammar is not None:
                    r.grammar.sync(r.output_token_ids)  # a no-op unless the tokens changed behind the matcher
                    masks[i] = r.grammar.allowed()
        if not masks:
            return logits
        rows = sorted(masks)
        allowed = torch.from_numpy(np.stack([masks[i] for i in rows])).to(logits.device)  # [len(rows), grammar vocab]
        vocab = logits.shape[-1]
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer's vocabulary: padding ids never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        logits = logits.clone()
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab], float("-inf"))
        return logits

    @staticmethod
    def filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """softmax(logits / T) with top-k, then top-p, then min-p applied per row; filtered tokens get 0.
        (Not renormalised: the draw only compares ratios.)"""
        n, vocab = logits.shape
        temps = torch.tensor([r.params.temperature for r in requests], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [r.params.top_k for r in requests]
        if any(0 < k < vocab for k in top_k):
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
            kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [n, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = torch.tensor([r.params.top_p for r in requests], device=logits.device)
        if bool((top_p < 1.0).any()):
            sorted_logits, order = logits.sort(dim=-1)  # ascending
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - top_p)[:, None]
            drop[:, -1] = False  # always keep the most likely token
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in requests], device=logits.device)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _unseeded_noise(self, rows: list[int], vocab: int) -> dict[int, torch.Tensor]:
        """Exp(1) noise for these rows from the sampler's own generator, drawn in one call (in row order)."""
        if not rows:
            return {}
        noise = _exponential(torch.rand(len(rows), vocab, device=self.device, generator=self.generator))
        return dict(zip(rows, noise))

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row, drawn from filtered_probs (exponential race: argmax of p / Exp(1) noise)."""
        probs = self.filtered_probs(logits, requests)
        vocab = probs.shape[-1]
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.generator is None]
        if unseeded:
            noise[unseeded] = _exponential(torch.rand(len(unseeded), vocab, device=probs.device,
                                                      generator=self.generator))
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i] = _exponential(torch.rand(vocab, device=probs.device, generator=r.generator))
        return (probs / noise).argmax(dim=-1)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def _exponential(uniform: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise as -log(U), in place: torch's CPU exponential_ took 24 ms for 16 rows of a 32k vocabulary,
    rand + log 2.5 ms (one thread; that was a sampled decode step's largest cost). U = 0 gives inf: that token
    loses the race, as its Exp(1) draw would almost surely."""
    return uniform.log_().neg_()


def _draft_masks(requests: list[Request], drafts: list[list[int]]) -> dict[int, np.ndarray]:
    """Grammar masks of every verify row of the constrained requests: row j of a request is its grammar advanced
    through drafts [:j] (then rolled back), so a draft the grammar forbids is rejected like any other."""
    masks, first = {}, 0
    for r, d in zip(requests, drafts):
        if r.grammar is not None:
            r.grammar.sync(r.output_token_ids)
            for j, mask in enumerate(r.grammar.draft_masks(d)):
                masks[first + j] = mask
        first += len(d) + 1
    return masks


def _logprob(lp: torch.Tensor, token_id: int, n: int) -> Logprob:
    value = lp[token_id]
    rank = int((lp > value).sum()) + 1
    top = lp.topk(n) if n else None
    top_map = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
    return Logprob(token_id=token_id, logprob=float(value), rank=rank, top=top_map)
