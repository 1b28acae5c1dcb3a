"""Step-failure isolation: when a step raises, find the request(s) that made it raise and fail only those.

Admission (admission.py) should make this unreachable; it is the second line. The engine calls the
batched runner and sampler as usual and pays nothing on that path beyond a snapshot of each seeded
request's generator (a few microseconds). Only after an exception:

- the forward pass is re-run on halves of the step's chunks, recursively, until each failing chunk stands
  alone (a chunk writes only its own KV slots, so re-running one is harmless); the chunks that run are
  kept, a lone chunk that still raises is the culprit;
- sampling is re-run one request at a time (its row, or its verify rows) from the same generator states, so
  every other request draws exactly the tokens it would have drawn in the batch, and one that still raises is
  the culprit.

Inputs: the step's chunks (or sampling rows). Outputs: the results of everything that worked, and a
{request: exception} map of the culprits for the engine to fail by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twospeed.engine.request import Logprob, Request
from twospeed.engine.runner import PromptLogits
from twospeed.engine.scheduler import ScheduledChunk

Execute = Callable[[list[ScheduledChunk]], tuple[torch.Tensor, list[ScheduledChunk], list[PromptLogits]]]
# (logits, requests, each one's draft tokens) -> (each one's emitted tokens, their logprobs); see Sampler.verify
Sample = Callable[[torch.Tensor, list[Request], list[list[int]]], tuple[list[list[int]], list[list[Logprob | None]]]]


def execute_isolating(execute: Execute, chunks: list[ScheduledChunk]
                      ) -> tuple[torch.Tensor | None, list[ScheduledChunk], list[PromptLogits], dict[Request, Exception]]:
    """execute(chunks), or on failure the same by halves: (logits of the chunks that ran, those sampling
    chunks in logits order, their prompt rows' logits, the culprits). logits is None when no sampling chunk ran."""
    try:
        logits, sampling, prompt = execute(chunks)
        return logits, sampling, prompt, {}
    except Exception as e:
        if len(chunks) == 1:
            return None, [], [], {chunks[0].request: e}
    parts = [execute_isolating(execute, half) for half in (chunks[:len(chunks) // 2], chunks[len(chunks) // 2:])]
    tensors = [logits for logits, _, _, _ in parts if logits is not None and len(logits)]
    sampling = [c for _, s, _, _ in parts for c in s]
    prompt = [p for _, _, ps, _ in parts for p in ps]
    failed = {req: e for _, _, _, f in parts for req, e in f.items()}
    return (torch.cat(tensors) if tensors else None), sampling, prompt, failed


def sample_isolating(sample: Sample, generator: torch.Generator, logits: torch.Tensor, requests: list[Request],
                     drafts: list[list[int]]) -> tuple[list[list[int]], list[list[Logprob | None]],
                                                       dict[Request, Exception]]:
    """sample(logits, requests, drafts), or on failure request by request (its 1 + len(draft) rows): (the tokens each
    request emits, [] for a culprit; their logprobs; the culprits). generator: the sampler's own, for unseeded rows."""
    states = [(g, g.get_state()) for g in [generator] + [r.generator for r in requests if r.generator is not None]]
    try:
        tokens, logprobs = sample(logits, requests, drafts)
        return list(tokens), list(logprobs), {}
    except Exception:
        for g, state in states:
            g.set_state(state)
    tokens: list[list[int]] = []
    logprobs: list[list[Logprob | None]] = []
    failed: dict[Request, Exception] = {}
    first = 0
    for req, draft in zip(requests, drafts):
        rows = logits[first:first + len(draft) + 1]
        first += len(draft) + 1
        try:
            (emitted,), (lps,) = sample(rows, [req], [draft])
        except Exception as e:
            emitted, lps, failed[req] = [], [], e
        tokens.append(emitted)
        logprobs.append(lps)
    return tokens, logprobs, failed
