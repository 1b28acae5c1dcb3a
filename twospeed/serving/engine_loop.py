"""EngineLoop: the one place an LLMEngine is stepped — commands in, each step's outputs and events out.

The loop is synchronous and owns the engine alone: only the thread that runs `run()` touches it. Other threads
talk to it through `submit()` (add a group of sequences, abort some, abort all, stop); between steps it drains
those commands, so an add or an abort waits at most one step, and when there is no work it sleeps on an event
instead of spinning. What it produces goes to a `Sink`, so the same loop serves two homes:
- a thread of the server's process (async_engine.py: the sink hands items to the event loop);
- a process of its own (engine_child.py: the sink writes them to a pipe), where no event loop, metrics
  render or JSON encoder competes with the step for the GIL.

Nothing a request does may kill the loop: add_request's ValueError goes back to the caller; a request the
engine failed alone (finish_reason "error") gets its error; an exception that escapes a step anyway fails the
sequences then in flight (each gets the error) and the loop goes on.

What happens is told to listeners (serving/events.py: a step ran, the load changed, a sequence ended with its
SLO verdict, a step failed), in the loop's thread. `judge` gives a finished sequence its verdict before the
listeners hear of it.

A command adds an `Admission` (request_group.py) with a token of the sender's choosing; the sink gets each item
with the token of the add it belongs to, so the sender finds its request group without a table of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from twospeed.engine.request import Request
from twospeed.serving.events import EngineEvent, FaultEvent, FinishEvent, Listener, LoadEvent, StepEvent, tell
from twospeed.schema.slo import Verdict
from twospeed.serving.request_group import Admission, EngineError, SequenceSpec, StreamItem

if TYPE_CHECKING:
    from twospeed.engine.engine import LLMEngine

log = logging.getLogger(__name__)

Judge = Callable[[str, Request], Verdict | None]  # (lane, finished request) -> its SLO verdict


@dataclass(slots=True)
class AddGroup:
    """Add every sequence of `admission` or none; the sink's `added(token, ...)` answers. `refused`: the sender
    found it bad already (its grammar did not compile): the loop only answers, with that error."""

    admission: Admission
    token: Any
    refused: BaseException | None = None


@dataclass(slots=True)
class AbortSequences:
    """Abort these sequences (unknown or finished ones are skipped); their KV blocks go back."""

    request_ids: list[str]


@dataclass(slots=True)
class AbortAll:
    """Abort every sequence in flight."""


Command = AddGroup | AbortSequences | AbortAll


def grammar_of(admission: Admission):
    """The request's StructuredOutput (every sequence of a request shares it), or None."""
    return admission.specs[0].params.structured if admission.specs else None


def compile_grammar(engine: LLMEngine, admission: Admission) -> None:
    """Compile the admission's grammar into the engine's cache in the sender's thread (never the loop's), so the
    add finds it built. Raises InvalidParam("structured") for a grammar that does not compile. This is the one
    compile a request's grammar gets: the server checks a schema's shape, not its grammar."""
    spec = grammar_of(admission)
    if spec is not None:
        engine.grammars.compile(spec)


def add_error(e: Exception) -> Exception:
    """What an add that raised answers: a ValueError as raised (bad input, its field named), anything else as a
    RuntimeError with its type (this request's problem only, never the loop's)."""
    return e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")


def judge_safely(judge: Judge | None, lane: str, request, aborted: bool) -> Verdict | None:
    """A finished sequence's SLO verdict (None when aborted or nobody judges); a judge that raises is logged."""
    if aborted or judge is None:
        return None
    try:
        return judge(lane, request)
    except Exception:
        log.exception("judging %s failed", request.request_id)
        return None


class Sink(Protocol):
    """Where the loop's results go (called in the loop's thread)."""

    def deliver(self, batch: list[tuple[Any, StreamItem]]) -> None:
        """Items with the token of the add they belong to: (token, item) in the order they happened."""

    def added(self, token: Any, count: int, error: BaseException | None) -> None:
        """The add command `token` (of `count` sequences) is done: all added (error None) or none."""

    def flush(self) -> None:
        """One pass of the loop is over (a step, or a batch of commands): send what was gathered."""


@dataclass(slots=True, eq=False)
class _Tracked:
    admission: Admission
    token: Any
    spec: SequenceSpec
    request: Request


class EngineLoop:
    def __init__(self, engine: LLMEngine, sink: Sink, *, judge: Judge | None = None,
                 listeners: list[Listener] = ()):
        self.engine = engine
        self.sink = sink
        self.judge = judge  # called when a sequence finishes (not when aborted)
        self.listeners: list[Listener] = list(listeners)  # each called with every EngineEvent, in the loop's thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self.num_waiting = 0  # the scheduler's waiting queue, as of the last step or command
        self.num_running = 0
        self.steps = 0
        self.step_failures = 0
        self._last_load: LoadEvent | None = None  # what the listeners last heard of the load

    # -- any thread -----------------------------------------------------------------------------
    def submit(self, command: Command) -> None:
        """Done before the next step."""
        self._commands.put(command)
        self._wake.set()

    def stop(self) -> None:
        """Abort what is left and return from run() (after the step in progress)."""
        self._commands.put(AbortAll())
        self._stop.set()
        self._wake.set()

    # -- the loop's thread ------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            self._wake.clear()
            changed = self._drain_commands()
            if self._stop.is_set():
                self._abort_all()
                self._publish_load()
                self.sink.flush()
                return
            if self.engine.has_unfinished_requests():
                self._step()
                self.sink.flush()
            else:
                if changed:
                    self._publish_load()
                    self.sink.flush()
                self._wake.wait(timeout=1.0)

    def _drain_commands(self) -> bool:
        changed = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            try:
                match cmd:
                    case AddGroup(admission, token, refused):
                        self._add(admission, token, refused)
                    case AbortSequences(request_ids):
                        batch = [self._abort(rid) for rid in request_ids]
                        self._post([b for b in batch if b is not None])
                    case AbortAll():
                        self._abort_all()
                    case _:
                        raise TypeError(f"not an engine command: {cmd!r}")
            except Exception:  # never let one command end the loop
                log.exception("engine command %s failed", type(cmd).__name__)

    def _add(self, adm: Admission, token, refused: BaseException | None) -> None:
        if refused is not None:
            self.sink.added(token, len(adm.specs), refused)
            return
        added: list[str] = []
        error: BaseException | None = None
        try:
            for spec in adm.specs:
                req = self.engine.add_request(spec.request_id, spec.prompt_token_ids, spec.params,
                                              arrival_time=adm.arrival_time, priority=adm.priority,
                                              itl_target=adm.itl_target, lane=adm.lane, speculate=adm.speculate)
                req.clock.routed = adm.routed_time
                self._tracked[spec.request_id] = _Tracked(adm, token, spec, req)
                added.append(spec.request_id)
        except Exception as e:  # ValueError for bad input; anything else is also this request's problem only
            error = add_error(e)
            for rid in added:
                self._tracked.pop(rid, None)
                self.engine.abort_request(rid)
        self.num_waiting = len(self.engine.scheduler.waiting)
        self.sink.added(token, len(adm.specs), error)

    def _abort(self, request_id: str) -> tuple[Any, StreamItem] | None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return None
        self.engine.abort_request(request_id)
        verdict = self._finish_hook(t, aborted=True)
        return t.token, StreamItem(request_id, t.spec.index, None, verdict)

    def _abort_all(self, error: BaseException | None = None) -> None:
        batch = []
        for rid in list(self._tracked):
            item = self._abort(rid)
            if item is not None:
                item[1].error = error
                batch.append(item)
        self._post(batch)

    def _finish_hook(self, t: _Tracked, aborted: bool) -> Verdict | None:
        verdict = judge_safely(self.judge, t.admission.lane, t.request, aborted)
        self._emit(FinishEvent(t.admission.lane, t.request, aborted, verdict))
        return verdict

    def _emit(self, event: EngineEvent) -> None:
        tell(self.listeners, event)

    def _step(self) -> None:
        isolated = self.engine.num_step_failures
        try:
            deltas = self.engine.step_deltas()
        except Exception as e:  # a bug, not bad input: fail what is in flight, keep serving
            self.step_failures += 1
            log.exception("engine step failed; failing %d in-flight sequences", len(self._tracked))
            self._emit(FaultEvent("step"))
            self._abort_all(EngineError(f"the engine failed this request: {type(e).__name__}: {e}"))
            self._publish_load()
            return
        self.steps += 1
        if self.engine.num_step_failures != isolated:
            self._emit(FaultEvent("request"))
        batch = []
        for delta in deltas:
            t = self._tracked.get(delta.request_id)
            if t is None:
                continue
            item = StreamItem(delta.request_id, t.spec.index, delta)
            if delta.finish is not None:
                if delta.finish.error is not None:
                    item.error = EngineError(delta.finish.error)
                del self._tracked[delta.request_id]
                item.verdict = self._finish_hook(t, aborted=delta.finish.error is not None)
            batch.append((t.token, item))
        self._post(batch)
        if self.engine.last_stats is not None:
            self._emit(StepEvent(self.engine.last_stats))
        self._publish_load()

    def _post(self, batch: list) -> None:
        if batch:
            self.sink.deliver(batch)

    def _publish_load(self) -> None:
        sched = self.engine.scheduler
        self.num_waiting = len(sched.waiting)
        self.num_running = len(sched.running)
        if not self.listeners:
            return
        lanes = {rid: t.admission.lane for rid, t in self._tracked.items()}
        running = Counter(lanes.get(r.request_id, "default") for r in sched.running)
        waiting = Counter(lanes.get(r.request_id, "default") for r in sched.waiting)
        kv = self.engine.kv
        load = LoadEvent(dict(running), dict(waiting), kv.usage, kv.num_cached_blocks)
        if load != self._last_load:  # a decode's step mostly leaves it as it was: nothing to tell or to send
            self._last_load = load
            self._emit(load)
