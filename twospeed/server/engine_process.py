"""ProcessEngine: the EngineLoop in a process of its own, so the HTTP side never takes the GIL from a step.

Why: in one process the engine thread shares the GIL with the event loop, and every torch op releases and
retakes it. Measured on two cores: a step of a 64-token chunk and 10 decodes took 101-110 ms alone and
484-1,906 ms beside one busy Python thread, and under load the event loop (a /metrics render, SSE encoding)
held the GIL in half of the samples. vLLM (its EngineCore process) and SGLang (its scheduler process) split the
same way.

The engine process (`engine_main`, a fresh interpreter: no torch or OpenMP state is inherited) builds
the LLMEngine, says `Ready` with its facts (server/engine_view.py), then runs the EngineLoop on its main thread;
a reader thread there passes the commands arriving on a pipe (the loop's own typed commands, and `StopEngine`)
to the loop, compiling a request's grammar first, so the loop finds it built. After each pass of the loop (a
step, or a batch of commands) it sends one `Outbox`: the adds it finished (`Added`, a refusal as the exception
raised: InvalidParam keeps its field), the events its listeners heard (a FinishEvent carries an EndedSequence,
not the Request) and the step's items, each with its request's RequestDelta (engine/outputs.py: only what is
new, never the whole output again).

This side (`ProcessEngine`, the EngineClient `twospeed serve` uses) sends commands from the event loop and reads
the messages on a thread of its own: it judges each finished sequence (the lanes' SLOs), tells its listeners
(the metrics, the dashboard's history), and hands each step's items to the event loop with one
call_soon_threadsafe, where each request's group adds its deltas up. Stamps cross as monotonic seconds: both
processes read the same clock, so the split clock is exact.

If the engine process dies, every open stream ends with an error event (not a hang), /health says so, and
new requests get a 503. If this process dies, the engine process sees its command pipe close and exits.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from twospeed.config import EngineConfig
from twospeed.server.engine_loop import AbortSequences, AddGroup, Command, EngineLoop, Judge, judge_safely
from twospeed.server.engine_view import EngineFacts, EngineView, load_tokenizer
from twospeed.server.errors import APIError
from twospeed.server.events import EndedSequence, EngineEvent, FinishEvent, Listener, tell
from twospeed.server.request_group import EngineError, RequestGroup, SequenceSpec, StreamItem, deliver_items
from twospeed.server.workers import resolve_future

log = logging.getLogger(__name__)



@dataclass(slots=True)
class EngineGroup:
    """A RequestGroup's admission fields, as the engine process gets them (no queue: that stays here)."""

    lane: str
    priority: int
    arrival_time: float  # monotonic seconds
    specs: list[SequenceSpec]
    itl_target: float | None = None
    speculate: bool | None = None
    routed_time: float | None = None


COST_EVERY = 1.0  # seconds between the cost model's snapshots to the server (the dashboard's calibrated costs)


@dataclass(slots=True)
class StopEngine:
    """The server's last command: abort what is left, say Stopped, exit."""


@dataclass(slots=True)
class Ready:
    """The engine is built: its facts (limits, tokenizer folder, pool, start-up cost fit)."""

    facts: EngineFacts


@dataclass(slots=True)
class StartFailed:
    """The engine could not be built: why (the exception itself where it pickles)."""

    error: BaseException


@dataclass(slots=True)
class Stopped:
    """The engine process is done; nothing follows."""


@dataclass(slots=True)
class Added:
    """An add command is done: all `count` sequences added (error None) or none (the error, as raised)."""

    token: int
    count: int
    error: BaseException | None = None


@dataclass(slots=True)
class Outbox:
    """One message from the engine process: what one pass of its loop did."""

    added: list[Added] = field(default_factory=list)
    events: list[EngineEvent] = field(default_factory=list)  # in the order the listeners heard them
    items: list[StreamItem] = field(default_factory=list)  # the step's deltas, in the order they happened
    num_waiting: int = 0
    num_running: int = 0
    cost_profile: dict | None = None  # the step cost model's coefficients, at most every COST_EVERY seconds

    def __bool__(self) -> bool:
        return bool(self.added or self.events or self.items)


# -- the engine process ------------------------------------------------------------------------------------
class _PipeSink:
    """The loop's Sink and listener in the engine process: gathers a pass's results and sends them at once."""

    def __init__(self, conn, loop: EngineLoop | None = None):
        self.conn = conn
        self.loop = loop
        self.box = Outbox()
        self.costs_sent, self.costs_observed = time.monotonic(), 0  # the ready message carried the first snapshot

    def deliver(self, batch: list[tuple[EngineGroup, StreamItem]]) -> None:
        self.box.items += [item for _, item in batch]

    def added(self, token: int, count: int, error: BaseException | None) -> None:
        self.box.added.append(Added(token, count, _portable(error)))

    def listen(self, event: EngineEvent) -> None:
        if isinstance(event, FinishEvent):
            event = FinishEvent(event.lane, EndedSequence.of(event.request), event.aborted, None)
        self.box.events.append(event)

    def flush(self) -> None:
        if not self.box:
            return
        box, self.box = self.box, Outbox()
        box.num_waiting, box.num_running = self.loop.num_waiting, self.loop.num_running
        self._attach_costs(box)
        self.conn.send(box)

    def _attach_costs(self, box: Outbox) -> None:
        """The cost model's snapshot, once it has learnt steps since the last one: every COST_EVERY seconds while
        busy, and when the engine goes idle (so the server's copy ends where the engine's fit ends)."""
        model, now = getattr(self.loop.engine, "cost_model", None), time.monotonic()
        idle = not (box.num_waiting or box.num_running)
        due = idle or now - self.costs_sent >= COST_EVERY
        if model is None or model.num_observed == self.costs_observed or not due:
            return
        box.cost_profile, self.costs_sent, self.costs_observed = model.profile(), now, model.num_observed


# The engine process's command line. Signals first: Ctrl-C and a service manager's SIGTERM reach the whole process
# group, and the server drains before it stops the engine (or exits, which closes the engine's pipe).
BOOT = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "from twospeed.server.engine_process import boot; boot()")


def boot() -> None:
    """The engine process's entry (BOOT): its pipes' file descriptors, the server's pid and the niceness to add are
    its arguments, the engine's config the first message."""
    cmd_fd, res_fd, server_pid, nice = (int(a) for a in sys.argv[1:5])
    if nice > 0:
        os.nice(nice)
    commands, results = Connection(cmd_fd, writable=False), Connection(res_fd, readable=False)
    engine_main(commands.recv(), commands, results, server_pid)


def engine_main(config: EngineConfig, commands, results, server_pid: int) -> None:
    """The engine process: build, say ready (or why not), then step until told to stop or the server is gone."""
    logging.basicConfig(format="twospeed engine: %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    try:
        from twospeed.engine.engine import LLMEngine
        from twospeed.engine.structured import warm_grammars

        engine = LLMEngine(config)
        warm_grammars(engine)
    except BaseException as e:
        results.send(StartFailed(_portable(e)))
        return
    if engine.threads is not None:  # the server's work (HTTP, tokenizing) is this service's, not a co-tenant's
        engine.threads.count_as_own((server_pid,))
    gc.freeze()  # the model and torch stay for good: no full collection walks them mid-step (server/state.py says why)
    sink = _PipeSink(results)
    loop = EngineLoop(engine, sink, listeners=[sink.listen])
    sink.loop = loop
    results.send(Ready(EngineFacts.of(engine, "engine", uuid.uuid4().hex[:12], str(os.getpid()))))
    threading.Thread(target=_read_commands, args=(commands, loop), name="twospeed-commands", daemon=True).start()
    loop.run()
    results.send(Stopped())


def _read_commands(commands, loop: EngineLoop) -> None:
    while True:
        try:
            cmd = commands.recv()
        except (EOFError, OSError):  # the server is gone
            loop.stop()
            return
        if isinstance(cmd, StopEngine):
            loop.stop()
            return
        if isinstance(cmd, AddGroup):
            _compile(loop.engine, cmd.group)
        loop.submit(cmd)


def _compile(engine, group: EngineGroup) -> None:
    """A grammar compiled into the engine's cache here, off the loop, so the add finds it built (the server has
    compiled it too, to check it: its cache is its own). A grammar that fails is the add's error, in the loop."""
    spec = group.specs[0].params.structured if group.specs else None
    if spec is not None:
        try:
            engine.grammars.compile(spec)
        except Exception:
            pass


def _portable(e: BaseException | None) -> BaseException | None:
    """The exception itself where it survives pickling (InvalidParam keeps its field), else a RuntimeError with its
    type and message: what crosses the pipe is always an exception the server can raise."""
    if e is None:
        return None
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


# -- the server's side -------------------------------------------------------------------------------------
class ProcessEngine:
    """EngineClient (server/engine_client.py) over an engine process."""

    def __init__(self, config: EngineConfig, *, judge: Judge | None = None, listeners: list[Listener] = (),
                 nice: int = 0):
        self.config = config
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
        cmd_recv, cmd_send = os.pipe()
        res_recv, res_send = os.pipe()
        # A fresh interpreter on its own entry point, not multiprocessing's spawn: that re-runs the user's main
        # module in the child, and a script without an `if __name__ == "__main__"` guard would start a server there.
        paths = (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))  # this very twospeed
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        argv = [sys.executable, "-c", BOOT, str(cmd_recv), str(res_send), str(os.getpid()), str(self.nice)]
        self._proc = subprocess.Popen(argv, pass_fds=(cmd_recv, res_send), stdin=subprocess.DEVNULL, env=env)
        os.close(cmd_recv)
        os.close(res_send)  # only the child's copy stays open: its exit is this side's EOF
        self._commands = Connection(cmd_send, readable=False)
        self._commands.send(self.config)
        results = Connection(res_recv, writable=False)
        self._reader = threading.Thread(target=self._read, args=(results,), name="twospeed-engine-reader",
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
        group.unfinished = {s.request_id for s in group.specs}
        token = next(self._tokens)
        sent = EngineGroup(group.lane, group.priority, group.arrival_time, group.specs, group.itl_target,
                           group.speculate, group.routed_time)
        with self._lock:
            if self._exited:
                raise _gone(self._proc)
            self._adds[token] = future
            for spec in group.specs:
                self._open[spec.request_id] = group
            self._pending += len(group.specs)
            self._send_locked(AddGroup(sent, token))
        try:
            await future
        except asyncio.CancelledError:  # the client left while we waited: the engine may have added them
            self.abort(group)
            raise

    def abort(self, group: RequestGroup) -> None:
        if group.unfinished:
            self._send(AbortSequences(list(group.unfinished)))

    def _send(self, command: Command | StopEngine) -> None:
        with self._lock:
            self._send_locked(command)

    def _send_locked(self, command: Command | StopEngine) -> None:
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



def _gone(proc) -> APIError:
    """What a request meets once the engine process has exited: 503 (the server cannot serve; /health says so)."""
    code = None if proc is None else proc.poll()
    return APIError(503, "the engine process exited" + (f" (exit code {code})" if code is not None else ""),
                    "service_unavailable")


def _choice(group: RequestGroup, request_id: str) -> int:
    return next(s.index for s in group.specs if s.request_id == request_id)
