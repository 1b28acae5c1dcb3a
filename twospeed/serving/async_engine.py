"""AsyncEngine: the EngineLoop (engine_loop.py) in one background thread of the server's process, its results
fed to per-request asyncio queues.

HTTP handlers talk to the loop through its command queue (add a group of sequences, abort one) and read results
from their group's asyncio.Queue; the thread hands each step's items to the event loop with one
call_soon_threadsafe. The engine thread shares this process's GIL with the event loop: a busy loop (a /metrics
render, JSON encoding) stretches the steps. `twospeed serve` therefore runs the engine in a process of its own
(process_engine.py); this thread form is for an engine built in this process (tests, `LLM`-style embedding, and
Ray replicas that are already a process of their own).

Build the engine in that thread (pass a builder, then `await ready()`): torch's OpenMP runtime (libgomp)
keeps one worker pool per thread that has run a parallel region, and once the pools hold more threads than
there are cores its workers stop spinning between regions and sleep, so every matmul pays a futex wake-up.
Loading the model in the main thread and stepping it in another cost 40% of a batch-1 decode step on two
cores (13 -> 18 ms; BENCHMARKS.md). With the build in the engine thread, that thread is the only pool.

Inputs: token ids and SamplingParams per sequence. Outputs: `StreamItem`s (the engine's
RequestOutput, the emission time of each new token, and the SLO verdict once finished).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from twospeed.serving.engine_loop import AbortSequences, AddGroup, EngineLoop, Judge, compile_grammar, grammar_of
from twospeed.serving.events import Listener
from twospeed.serving.request_group import RequestGroup, StreamItem, deliver_items, resolve_future

if TYPE_CHECKING:  # torch comes with it: a server whose engine steps in its own process never imports it
    from twospeed.engine.engine import LLMEngine


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], *, judge: Judge | None = None,
                 listeners: list[Listener] = ()):
        # an engine, or a builder that start() runs in the engine thread (see the module docstring)
        from twospeed.engine.engine import LLMEngine

        self._build = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine | None = engine if self._build is None else None
        self._ready: asyncio.Future | None = None
        # The loop exists from the start: commands sent while the engine still builds wait in its queue.
        self._core = EngineLoop(self.engine, self, judge=judge, listeners=listeners)
        self.listeners = self._core.listeners  # the loop's own list: listeners appended later are heard too
        self._lock = threading.Lock()
        self._pending = 0  # sequences sent to the thread, not yet added
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

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

    @property
    def steps(self) -> int:
        return self._core.steps

    @property
    def step_failures(self) -> int:
        return self._core.step_failures

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        self._core.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # -- event-loop side ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences admitted but not yet scheduled (including those still on their way to the thread)."""
        return self._core.num_waiting + self._pending

    @property
    def num_running(self) -> int:
        return self._core.num_running

    async def add(self, group: RequestGroup) -> None:
        """Add every sequence of the group, or none: raises ValueError (the first bad one's message). Its grammar
        is compiled here, in a worker thread, never in the engine's."""
        if grammar_of(group.admission) is not None and self.engine is not None:
            await asyncio.to_thread(compile_grammar, self.engine, group.admission)
        future = asyncio.get_running_loop().create_future()
        admission = group.admit()
        with self._lock:
            self._pending += len(group.specs)
        self._core.submit(AddGroup(admission, (group, future)))
        try:
            await future
        except asyncio.CancelledError:  # the client left while we waited: the thread may have added them
            self.abort(group)
            raise

    def abort(self, group: RequestGroup) -> None:
        """Abort the group's unfinished sequences (thread-safe, idempotent); their KV blocks go back."""
        if group.unfinished:
            self._core.submit(AbortSequences(list(group.unfinished)))

    # -- the Sink the loop writes to (engine thread) ----------------------------------------------
    def deliver(self, batch: list[tuple[tuple[RequestGroup, asyncio.Future], StreamItem]]) -> None:
        self._loop.call_soon_threadsafe(deliver_items, [(group, item) for (group, _), item in batch])

    def added(self, token: tuple[RequestGroup, asyncio.Future], count: int, error: BaseException | None) -> None:
        with self._lock:
            self._pending -= count
        self._loop.call_soon_threadsafe(resolve_future, token[1], error, None)

    def flush(self) -> None:
        pass

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        from twospeed.engine.structured import warm_grammars  # llguidance: only where an engine runs

        try:
            if self._build is not None:
                self.engine = self._core.engine = self._build()
            warm_grammars(self.engine)  # here, not on the first structured request (structured.py)
        except BaseException as e:  # the handler awaiting ready() gets it; nothing to step
            self._loop.call_soon_threadsafe(resolve_future, self._ready, e, None)
            return
        self._loop.call_soon_threadsafe(resolve_future, self._ready, None, self.engine)
        self._core.run()


def monotonic_to_unix() -> Callable[[float], float]:
    """Map time.monotonic() stamps to Unix time (seconds), for clients comparing with their own clock."""
    offset = time.time() - time.monotonic()
    return lambda t: t + offset
