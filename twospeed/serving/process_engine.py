"""ProcessEngine: the EngineLoop in a process of its own (engine_child.py), so the HTTP side never takes the GIL
from a step; this is the server's side of it, the EngineClient `twospeed serve` uses.

Why: in one process the engine thread shares the GIL with the event loop, and every torch op releases and
retakes it. Measured on two cores: a step of a 64-token chunk and 10 decodes took 101-110 ms alone and
484-1,906 ms beside one busy Python thread, and under load the event loop (a /metrics render, SSE encoding)
held the GIL in half of the samples. vLLM (its EngineCore process) and SGLang (its scheduler process) split the
same way.

This side sends the typed commands (process_messages.py) from the event loop and reads the engine's messages on a
thread of its own: it judges each finished sequence (the lanes' SLOs), tells its listeners (the metrics, the
dashboard's history), and hands each step's items to the event loop with one call_soon_threadsafe, where each
request's group adds its deltas up. Stamps cross as monotonic seconds: both processes read the same clock, so the
split clock is exact.

If the engine process dies, every open stream ends with an error event (not a hang), /health says so, and
new requests get EngineGone (a 503). If this process dies, the engine process sees its command pipe close and
exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import threading

from twospeed.config import EngineConfig
from twospeed.serving.engine_loop import AbortSequences, AddGroup, Judge, judge_safely
from twospeed.serving.engine_spawn import EngineSpawn
from twospeed.serving.engine_view import EngineFacts, EngineView, load_tokenizer
from twospeed.serving.events import FinishEvent, Listener, tell
from twospeed.serving.process_messages import Outbox, Ready, StartFailed, StopEngine, Stopped, ToEngine
from twospeed.serving.request_group import (EngineError, EngineGone, RequestGroup, StreamItem, deliver_items,
                                            resolve_future)

log = logging.getLogger(__name__)


class ProcessEngine:
    """EngineClient (serving/engine_client.py) over an engine process."""

    def __init__(self, config: EngineConfig | EngineSpawn, *, judge: Judge | None = None,
                 listeners: list[Listener] = (), nice: int = 0):
        """config: the engine's, or an engine process already started with it (then `nice` is what it got)."""
        self._spawn = config if isinstance(config, EngineSpawn) else None
        self.config = config.config if isinstance(config, EngineSpawn) else config
        self.nice = nice  # added to the engine process's niceness (ServerConfig.engine_nice)
        self._judge = judge
        self.listeners: list[Listener] = list(listeners)  # called on the reader thread, in the engine's order
        self._tokens = itertools.count()
        self._adds: dict[int, asyncio.Future] = {}
        self._open: dict[str, RequestGroup] = {}  # request id -> its group, until its last item
        self._lock = threading.Lock()  # the command pipe and the tables above
        self._pending = 0  # sequences sent, not yet added
        self._num_waiting = self._num_running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._proc = None
        self._commands = None
        self._reader: threading.Thread | None = None
        self._exited = False
        self._view: EngineView | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        spawn = self._spawn or EngineSpawn.start(self.config, self.nice)
        self._spawn = None
        self._proc, self._commands = spawn.process, spawn.commands
        self._reader = threading.Thread(target=self._read, args=(spawn.results,), name="twospeed-engine-reader",
                                        daemon=True)
        self._reader.start()

    async def ready(self) -> EngineView:
        return await asyncio.shield(self._ready)

    @property
    def is_alive(self) -> bool:
        return self._proc is not None and not self._exited and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the engine process and wait for it (killed past the timeout)."""
        self._send(StopEngine())
        if self._proc is None:
            return
        try:
            await asyncio.to_thread(self._proc.wait, timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            await asyncio.to_thread(self._proc.wait, 5)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, timeout)

    # -- event-loop side ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting + self._pending

    @property
    def num_running(self) -> int:
        return self._num_running

    async def add(self, group: RequestGroup) -> None:
        """Add every sequence of the group, or none: raises ValueError (InvalidParam names the field)."""
        future = asyncio.get_running_loop().create_future()
        admission = group.admit()
        token = next(self._tokens)
        with self._lock:
            if self._exited:
                raise _gone(self._proc)
            self._adds[token] = future
            for spec in group.specs:
                self._open[spec.request_id] = group
            self._pending += len(group.specs)
            self._send_locked(AddGroup(admission, token))
        try:
            await future
        except asyncio.CancelledError:  # the client left while we waited: the engine may have added them
            self.abort(group)
            raise

    def abort(self, group: RequestGroup) -> None:
        if group.unfinished:
            self._send(AbortSequences(list(group.unfinished)))

    def _send(self, command: ToEngine) -> None:
        with self._lock:
            self._send_locked(command)

    def _send_locked(self, command: ToEngine) -> None:
        if self._commands is None or self._exited:
            return
        try:
            self._commands.send(command)
        except (OSError, ValueError):  # the engine process is gone: the reader ends what was open
            pass

    # -- reader thread --------------------------------------------------------------------------
    def _read(self, results) -> None:
        try:
            while True:
                match results.recv():
                    case Outbox() as box:
                        self._receive(box)
                    case Ready(facts):
                        self._started(facts)
                    case StartFailed(error):
                        self._loop.call_soon_threadsafe(resolve_future, self._ready, error, None)
                    case Stopped():
                        break
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("reading the engine process failed")
        self._ended()

    def _started(self, facts: EngineFacts) -> None:
        try:
            view = EngineView([facts], load_tokenizer(facts))
        except Exception as e:
            self._loop.call_soon_threadsafe(resolve_future, self._ready, e, None)
            return
        self._view = view
        self._loop.call_soon_threadsafe(resolve_future, self._ready, None, view)

    def _receive(self, box: Outbox) -> None:
        if box.cost_profile is not None and self._view is not None:
            self._view.update_costs(box.cost_profile)
        with self._lock:
            self._num_waiting, self._num_running = box.num_waiting, box.num_running
            resolved = []
            for done in box.added:
                self._pending -= done.count
                resolved.append((self._adds.pop(done.token), done.error))
        for future, error in resolved:
            self._loop.call_soon_threadsafe(resolve_future, future, error, None)
        verdicts = {}
        for event in box.events:
            if isinstance(event, FinishEvent):
                event.verdict = judge_safely(self._judge, event.lane, event.request, event.aborted)
                verdicts[event.request.request_id] = event.verdict
            tell(self.listeners, event)
        batch = []
        with self._lock:
            for item in box.items:
                group = self._open.get(item.request_id)
                if group is None:
                    continue
                if item.finished:
                    item.verdict = verdicts.get(item.request_id)
                    del self._open[item.request_id]
                batch.append((group, item))
        if batch:
            self._loop.call_soon_threadsafe(deliver_items, batch)

    def _ended(self) -> None:
        """The engine process is gone (stopped, or died): end everything still open with an error."""
        with self._lock:
            self._exited = True
            adds, self._adds = list(self._adds.values()), {}
            open_, self._open = list(self._open.items()), {}
            self._pending = 0
        why = str(_gone(self._proc))
        if not self._ready.done():
            self._loop.call_soon_threadsafe(resolve_future, self._ready, RuntimeError(why), None)
        for future in adds:
            self._loop.call_soon_threadsafe(resolve_future, future, _gone(self._proc), None)
        batch = [(group, StreamItem(rid, _choice(group, rid), None, error=EngineError(why))) for rid, group in open_]
        if batch:
            self._loop.call_soon_threadsafe(deliver_items, batch)



def _gone(proc) -> EngineGone:
    """What a request meets once the engine process has exited (the server cannot serve; /health says so)."""
    code = None if proc is None else proc.poll()
    return EngineGone("the engine process exited" + (f" (exit code {code})" if code is not None else ""))


def _choice(group: RequestGroup, request_id: str) -> int:
    return next(s.index for s in group.specs if s.request_id == request_id)
