"""AsyncEngine: LLMEngine.step() in one background thread, results fed to per-request asyncio queues.

The engine core stays synchronous and single-threaded: only the engine thread touches the
LLMEngine. HTTP handlers talk to it through a command queue (add a group of sequences,
abort one) and read results from an asyncio.Queue per HTTP request; the thread hands each
step's deltas to the event loop with one call_soon_threadsafe. Between steps the thread
drains commands, so an add or an abort waits at most one step; when there is no work it
sleeps on an event instead of spinning.

Build the engine in that thread (pass a builder, then `await ready()`): torch's OpenMP runtime (libgomp)
keeps one worker pool per thread that has run a parallel region, and once the pools hold more threads than
there are cores its workers stop spinning between regions and sleep, so every matmul pays a futex wake-up.
Loading the model in the main thread and stepping it in another cost 40% of a batch-1 decode step on two
cores (13 -> 18 ms; BENCHMARKS.md). With the build in the engine thread, that thread is the only pool.

Nothing a request does may kill the thread: add_request's ValueError goes back to the
handler (a 400); a request the engine failed alone (finish_reason "error": the engine
isolated a step failure to it) gets its error; an exception that escapes a step anyway
fails the sequences then in flight (each handler gets the error) and the loop goes on.

What happens is told to a list of listeners (server/events.py: a step ran, the load changed, a sequence
ended with its SLO verdict, a step failed), in the engine thread; the metrics and the dashboard's history
listen. `judge` gives a finished sequence its verdict before the listeners hear of it.

Inputs: token ids and SamplingParams per sequence. Outputs: `StreamItem`s (the engine's
RequestOutput, the emission time of each new token, and the SLO verdict once finished).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from twospeed.engine.engine import LLMEngine
from twospeed.engine.request import Request, RequestOutput
from twospeed.engine.sampling_params import SamplingParams
from twospeed.server.events import EngineEvent, FaultEvent, FinishEvent, Listener, LoadEvent, StepEvent
from twospeed.server.slo import Verdict

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceSpec:
    """One engine request of an HTTP request (a choice: prompt i, sample j)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int  # the choice index in the response


@dataclass(slots=True)
class StreamItem:
    request_id: str
    index: int  # choice index
    output: RequestOutput | None  # None when the sequence was aborted
    token_times: list[float]  # monotonic emission time of each of output.new_token_ids
    verdict: Verdict | None = None  # set on the sequence's last item
    error: BaseException | None = None  # the engine failed this sequence
    ends_group: bool = False  # the event loop closed the whole group (RequestGroup.close)

    @property
    def finished(self) -> bool:
        return self.output is None or self.error is not None or self.output.finished


class EngineError(RuntimeError):
    """The engine failed this sequence (a bug, not the client's input)."""


class ShutdownError(RuntimeError):
    """The server shut down before this request finished."""


@dataclass(eq=False)
class RequestGroup:
    """The sequences of one HTTP request and the queue their items arrive on (event-loop side)."""

    lane: str
    priority: int
    arrival_time: float
    specs: list[SequenceSpec]
    itl_target: float | None = None  # seconds: the lane's tightest ITL objective (LaneSLO.itl_target)
    speculate: bool | None = None  # the lane's speculation policy (LaneSLO.speculate)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    routed_time: float | None = None  # behind a router: arrival at this replica (arrival_time is at the router)
    replica: str | None = None  # behind a router: the replica serving it (the x-twospeed-replica header)

    async def next(self) -> StreamItem:
        item = await self.queue.get()
        if item.ends_group:
            self.unfinished.clear()
        elif item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def close(self, error: BaseException) -> None:
        """End the group from the event loop now (shutdown): its reader's next item carries `error`. The engine
        side is aborted separately (AsyncEngine.abort)."""
        self.queue.put_nowait(StreamItem("", -1, None, [], error=error, ends_group=True))

    @property
    def done(self) -> bool:
        return not self.unfinished


@dataclass(slots=True, eq=False)
class _Tracked:
    group: RequestGroup
    spec: SequenceSpec
    request: Request


Judge = Callable[[str, Request], Verdict | None]  # (lane, finished request) -> its SLO verdict


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], *, judge: Judge | None = None,
                 listeners: list[Listener] = ()):
        # an engine, or a builder that start() runs in the engine thread (see the module docstring)
        self._build = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine | None = engine if self._build is None else None
        self._ready: asyncio.Future | None = None
        self._judge = judge  # called in the engine thread when a sequence finishes (not when aborted)
        self.listeners: list[Listener] = list(listeners)  # each called with every EngineEvent, in the engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._lock = threading.Lock()
        self._pending = 0  # sequences sent to the thread, not yet added
        self._num_waiting = 0  # the scheduler's waiting queue, as of the last step
        self._num_running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.step_failures = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (it builds the engine first when given a builder; see ready())."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="twospeed-engine", daemon=True)
        self._thread.start()

    async def ready(self) -> LLMEngine:
        """The engine, once built in the engine thread; raises what the builder raised."""
        return await asyncio.shield(self._ready)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        self._commands.put(("abort_all",))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # -- event-loop side ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences admitted but not yet scheduled (including those still on their way to the thread)."""
        return self._num_waiting + self._pending

    @property
    def num_running(self) -> int:
        return self._num_running

    async def add(self, group: RequestGroup) -> None:
        """Add every sequence of the group, or none: raises ValueError (the first bad one's message)."""
        future = asyncio.get_running_loop().create_future()
        group.unfinished = {s.request_id for s in group.specs}
        with self._lock:
            self._pending += len(group.specs)
        self._commands.put(("add", group, future))
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:  # the client left while we waited: the thread may have added them
            self.abort(group)
            raise

    def abort(self, group: RequestGroup) -> None:
        """Abort the group's unfinished sequences (thread-safe, idempotent); their KV blocks go back."""
        if group.unfinished:
            self._commands.put(("abort", list(group.unfinished)))
            self._wake.set()

    def _deliver(self, batch: list[tuple[RequestGroup, StreamItem]]) -> None:
        for group, item in batch:
            group.queue.put_nowait(item)

    def _resolve(self, future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(self.engine if future is self._ready else None)
        else:
            future.set_exception(error)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._build is not None:
                self.engine = self._build()
        except BaseException as e:  # the handler awaiting ready() gets it; nothing to step
            self._loop.call_soon_threadsafe(self._resolve, self._ready, e)
            return
        self._loop.call_soon_threadsafe(self._resolve, self._ready, None)
        while True:
            self._wake.clear()
            changed = self._drain_commands()
            if self._stop.is_set():
                self._abort_all()
                self._publish_load()
                return
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                if changed:
                    self._publish_load()
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
                if cmd[0] == "add":
                    self._add(cmd[1], cmd[2])
                elif cmd[0] == "abort":
                    batch = [self._abort(rid) for rid in cmd[1]]
                    self._post([b for b in batch if b is not None])
                elif cmd[0] == "abort_all":
                    self._abort_all()
            except Exception:  # never let one command end the loop
                log.exception("engine command %s failed", cmd[0])

    def _add(self, group: RequestGroup, future: asyncio.Future) -> None:
        added: list[str] = []
        error: BaseException | None = None
        try:
            for spec in group.specs:
                req = self.engine.add_request(spec.request_id, spec.prompt_token_ids, spec.params,
                                              arrival_time=group.arrival_time, priority=group.priority,
                                              itl_target=group.itl_target, lane=group.lane,
                                              speculate=group.speculate)
                req.clock.routed = group.routed_time
                self._tracked[spec.request_id] = _Tracked(group, spec, req)
                added.append(spec.request_id)
        except Exception as e:  # ValueError for bad input; anything else is also this request's problem only
            error = e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")
            for rid in added:
                self._tracked.pop(rid, None)
                self.engine.abort_request(rid)
        with self._lock:
            self._pending -= len(group.specs)
        self._num_waiting = len(self.engine.scheduler.waiting)
        self._loop.call_soon_threadsafe(self._resolve, future, error)

    def _abort(self, request_id: str) -> tuple[RequestGroup, StreamItem] | None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return None
        self.engine.abort_request(request_id)
        verdict = self._finish_hook(t, aborted=True)
        return t.group, StreamItem(request_id, t.spec.index, None, [], verdict)

    def _abort_all(self, error: BaseException | None = None) -> None:
        batch = []
        for rid in list(self._tracked):
            item = self._abort(rid)
            if item is not None:
                item[1].error = error
                batch.append(item)
        self._post(batch)

    def _finish_hook(self, t: _Tracked, aborted: bool) -> Verdict | None:
        verdict = None
        if not aborted and self._judge is not None:
            try:
                verdict = self._judge(t.group.lane, t.request)
            except Exception:
                log.exception("judging %s failed", t.request.request_id)
        self._emit(FinishEvent(t.group.lane, t.request, aborted, verdict))
        return verdict

    def _emit(self, event: EngineEvent) -> None:
        """Tell every listener; one that raises is logged and the rest still hear it."""
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("listener %r failed on %s", listener, type(event).__name__)

    def _step(self) -> None:
        isolated = self.engine.num_step_failures
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug, not bad input: fail what is in flight, keep serving
            self.step_failures += 1
            log.exception("engine step failed; failing %d in-flight sequences", len(self._tracked))
            self._fault("step")
            self._abort_all(EngineError(f"the engine failed this request: {type(e).__name__}: {e}"))
            self._publish_load()
            return
        self.steps += 1
        if self.engine.num_step_failures != isolated:
            self._fault("request")
        batch = []
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            k = len(out.new_token_ids)
            item = StreamItem(out.request_id, t.spec.index, out, t.request.clock.token_times[-k:] if k else [])
            if out.error is not None:
                item.error = EngineError(out.error)
            if out.finished:
                del self._tracked[out.request_id]
                item.verdict = self._finish_hook(t, aborted=out.error is not None)
            batch.append((t.group, item))
        self._post(batch)
        if self.engine.last_stats is not None:
            self._emit(StepEvent(self.engine.last_stats))
        self._publish_load()

    def _fault(self, scope: str) -> None:
        self._emit(FaultEvent(scope))

    def _post(self, batch: list) -> None:
        if batch:
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def _publish_load(self) -> None:
        sched = self.engine.scheduler
        self._num_waiting = len(sched.waiting)
        self._num_running = len(sched.running)
        if not self.listeners:
            return
        lanes = {rid: t.group.lane for rid, t in self._tracked.items()}
        running = Counter(lanes.get(r.request_id, "default") for r in sched.running)
        waiting = Counter(lanes.get(r.request_id, "default") for r in sched.waiting)
        kv = self.engine.kv
        self._emit(LoadEvent(dict(running), dict(waiting), kv.usage, kv.num_cached_blocks))


def monotonic_to_unix() -> Callable[[float], float]:
    """Map time.monotonic() stamps to Unix time (seconds), for clients comparing with their own clock."""
    offset = time.time() - time.monotonic()
    return lambda t: t + offset
