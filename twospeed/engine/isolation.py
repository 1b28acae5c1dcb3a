"""Step-failure isolation: when a step raises, find the request(s) that made it raise and fail only those.

Admission (admission.py) should make this unreachable; it is the second line. The engine calls the
batched runner and sampler as usual and pays nothing on that path beyond a snapshot of each seeded
request's generator (a few microseconds). Only after an exception:

- the forward pass is re-run on halves of the step's chunks, recursively, until each failing chunk stands
  alone (a chunk writes only its own KV slots, so re-running one is harmless); the chunks that run are
  kept, a lone chunk that still raises is the culprit;
- sampling is re-run one row at a time from the same generator states, so every other row draws exactly
  the token it would have drawn in the batch, and a row that still raises is the culprit.

Inputs: the step's chunks (or sampling rows). Outputs: the results of everything that worked, and a
{request: exception} map of the culprits for the engine to fail by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from twospeed.engine.request import Logprob, Request
from twospeed.engine.scheduler import ScheduledChunk

Execute = Callable[[list[ScheduledChunk]], tuple[torch.Tensor, list[ScheduledChunk]]]
Sample = Callable[[torch.Tensor, list[Request]], tuple[list[int], list[Logprob | None]]]


def execute_isolating(execute: Execute, chunks: list[ScheduledChunk]
                      ) -> tuple[torch.Tensor | None, list[ScheduledChunk], dict[Request, Exception]]:
    """execute(chunks), or on failure the same by halves: (logits of the chunks that ran, those sampling
    chunks in logits order, the culprits). logits is None when no sampling chunk ran."""
    try:
        logits, sampling = execute(chunks)
        return logits, sampling, {}
    except Exception as e:
        if len(chunks) == 1:
            return None, [], {chunks[0].request: e}
    parts = [execute_isolating(execute, half) for half in (chunks[:len(chunks) // 2], chunks[len(chunks) // 2:])]
    tensors = [logits for logits, _, _ in parts if logits is not None and len(logits)]
    sampling = [c for _, s, _ in parts for c in s]
    failed = {req: e for _, _, f in parts for req, e in f.items()}
    return (torch.cat(tensors) if tensors else None), sampling, failed


def sample_isolating(sample: Sample, generator: torch.Generator, logits: torch.Tensor, requests: list[Request]
                     ) -> tuple[list[int | None], list[Logprob | None], dict[Request, Exception]]:
    """sample(logits, requests), or on failure row by row: (a token per row, None for a culprit's; logprobs;
    the culprits). generator: the sampler's own, for unseeded rows."""
    states = [(g, g.get_state()) for g in [generator] + [r.generator for r in requests if r.generator is not None]]
    try:
        tokens, logprobs = sample(logits, requests)
        return list(tokens), logprobs, {}
    except Exception:
        for g, state in states:
            g.set_state(state)
    tokens: list[int | None] = []
    logprobs: list[Logprob | None] = []
    failed: dict[Request, Exception] = {}
    for i, req in enumerate(requests):
        try:
            (token,), (lp,) = sample(logits[i:i + 1], [req])
        except Exception as e:
            token, lp, failed[req] = None, None, e
        tokens.append(token)
        logprobs.append(lp)
    return tokens, logprobs, failed
