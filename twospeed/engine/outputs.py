"""What a step tells about each request it touched: only what changed.

A `RequestDelta` carries the step's new token ids, their text, their emission times and their logprobs; the
request's last delta also carries its `Finish` (why it ended, its whole text, and its clock, bill and
speculation trace, each once). Nothing in a delta grows with the request's length, so a stream's cost per step
is flat however long it runs: the engine loop sends one list of deltas per step to whoever serves the requests
(a thread, a process, a replica), and the receiver adds them up (`SequenceOutput`) where it needs the whole.

Torch-free: the server's process and a cluster's ingress read these without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twospeed.engine.request import Bill, Clock, Logprob, RequestOutput, SpecTrace


@dataclass(slots=True)
class Finish:
    """How a request ended: sent once, with its last delta."""

    reason: str  # finish_reason: "stop", "length", "abort" or "error"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    text: str  # the whole output text (a stop string cut off, a failed request's text as it stood)
    clock: Clock
    bill: Bill
    spec: SpecTrace | None = None  # speculation's acceptance trace (None where the engine does not speculate)
    num_preemptions: int = 0
    error: str | None = None  # why the engine failed it (reason "error")
    prompt_logprobs: list[Logprob | None] | None = None  # when asked: per prompt token, None for the first


@dataclass(slots=True)
class RequestDelta:
    """One request's change in one step."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    token_times: list[float] = field(default_factory=list)  # emission time of each new token (the engine's clock)
    new_logprobs: list[Logprob] | None = None  # one per new token, when the request asked for logprobs
    finish: Finish | None = None  # set on the request's last delta

    @property
    def finished(self) -> bool:
        return self.finish is not None


class SequenceOutput:
    """A request's deltas added up: its tokens and logprobs so far, and the whole output once finished (the text
    comes whole with the Finish). Appends only, so taking a delta costs what the delta holds."""

    __slots__ = ("request_id", "prompt_token_ids", "token_ids", "logprobs", "finish")

    def __init__(self, request_id: str, prompt_token_ids: list[int], logprobs: bool):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] | None = [] if logprobs else None
        self.finish: Finish | None = None

    def add(self, delta: RequestDelta) -> None:
        self.token_ids += delta.new_token_ids
        if self.logprobs is not None and delta.new_logprobs:
            self.logprobs += delta.new_logprobs
        if delta.finish is not None:
            self.finish = delta.finish

    def output(self, prompt: str | None = None) -> RequestOutput:
        """The whole output as `LLM.generate` returns it (built once, at the end)."""
        f = self.finish
        if f is None:
            raise ValueError(f"request {self.request_id} has not finished")
        return RequestOutput(
            request_id=self.request_id, prompt=prompt, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids), text=f.text, new_token_ids=[], new_text="", finished=True,
            finish_reason=f.reason, stop_reason=f.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None, clock=f.clock, bill=f.bill,
            num_preemptions=f.num_preemptions, error=f.error, spec=f.spec, prompt_logprobs=f.prompt_logprobs)
