"""When a request ends: the one stop and length policy, shared by LLMEngine and the planner's simulator.

`check_stop(req, new_tokens)` looks at output tokens just appended to the request (one per step; more when a
grammar forced some, or a draft was accepted) in order and answers at the first one that ends it:
EOS (unless ignore_eos), a stop token id, a stop string the detokenizer found across token boundaries, the
grammar's document complete (only once min_tokens are out), else max_output_tokens reached (length). The
request's detokenizer, when it has one, is fed each checked token (that is how stop strings are found).
`finish_if_stopped` applies the answer: the stop reason recorded, the request finished by the scheduler (its
KV blocks back in the pool at once). No torch: the simulator's requests go through the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from twospeed.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from twospeed.engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Stop:
    """Why a request ends, and where."""

    status: RequestStatus  # FINISHED_STOPPED or FINISHED_LENGTH
    reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, grammar, length)
    num_tokens: int = 1  # of the new tokens, those the request keeps (up to and including the one that ended it)


def check_stop(req: Request, new_tokens: Sequence[int]) -> Stop | None:
    """The first of `new_tokens` (the last len(new_tokens) of req.output_token_ids) that ends the request, or
    None. The grammar, which the caller advanced over all of them, is asked only after the last one."""
    before = len(req.output_token_ids) - len(new_tokens)
    for i, token in enumerate(new_tokens):
        count = before + i + 1  # output tokens up to and including this one
        stop_str = req.detokenizer.add_tokens([token]) if req.detokenizer is not None else None
        if count >= req.params.min_tokens:
            if token in req.eos_token_ids:
                return Stop(RequestStatus.FINISHED_STOPPED, None, i + 1)
            if token in req.params.stop_token_ids:
                return Stop(RequestStatus.FINISHED_STOPPED, token, i + 1)
            if stop_str is not None:
                return Stop(RequestStatus.FINISHED_STOPPED, stop_str, i + 1)
            if i == len(new_tokens) - 1 and req.grammar is not None and req.grammar.is_complete:
                return Stop(RequestStatus.FINISHED_STOPPED, None, i + 1)  # complete: no need to wait for EOS
        if count >= req.max_output_tokens:
            return Stop(RequestStatus.FINISHED_LENGTH, None, i + 1)
    return None


def finish_if_stopped(scheduler: Scheduler, req: Request, new_tokens: Sequence[int]) -> Stop | None:
    """check_stop, and when it says stop: record the reason and finish the request (its blocks are freed now)."""
    stop = check_stop(req, new_tokens)
    if stop is not None:
        req.stop_reason = stop.reason
        scheduler.finish_request(req, stop.status)
    return stop
