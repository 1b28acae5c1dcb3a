"""The engine process: the EngineLoop on its main thread, its commands read from a pipe, its results written to one.

Started by EngineSpawn (engine_spawn.py) as a fresh interpreter on its `BOOT` line (no torch or OpenMP state is
inherited), it builds the LLMEngine, says `Ready` with its facts (engine_view.py), then runs the loop. A reader
thread passes the commands arriving on the pipe to the loop; it compiles a request's grammar first (the one compile
it gets), so the loop finds it built, and a grammar that fails is the add's refusal without the loop compiling it.
After each pass of the loop (a step, or a batch of commands) the sink sends one `Outbox` (process_messages.py):
the adds it finished, the events its listeners heard (a FinishEvent carries an EndedSequence, not the Request) and
the step's items, each with its request's RequestDelta (only what is new, never the whole output again).

If the server's process dies, the command pipe closes and this process stops.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

from twospeed.config import EngineConfig
from twospeed.serving.engine_loop import AddGroup, EngineLoop, add_error, compile_grammar, grammar_of
from twospeed.serving.engine_view import EngineFacts
from twospeed.serving.events import EndedSequence, EngineEvent, FinishEvent
from twospeed.serving.process_messages import (COST_EVERY, Added, Outbox, Ready, StartFailed, StopEngine, Stopped,
                                               portable)
from twospeed.serving.request_group import StreamItem


class _PipeSink:
    """The loop's Sink and listener in the engine process: gathers a pass's results and sends them at once."""

    def __init__(self, conn, loop: EngineLoop | None = None):
        self.conn = conn
        self.loop = loop
        self.box = Outbox()
        self.costs_sent, self.costs_observed = time.monotonic(), 0  # the ready message carried the first snapshot

    def deliver(self, batch: list[tuple[Any, StreamItem]]) -> None:
        self.box.items += [item for _, item in batch]

    def added(self, token: int, count: int, error: BaseException | None) -> None:
        self.box.added.append(Added(token, count, portable(error)))

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


def boot() -> None:
    """The engine process's entry (engine_spawn.BOOT): its pipes' file descriptors, the server's pid and the niceness
    to add are its arguments, the engine's config the first message."""
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
        results.send(StartFailed(portable(e)))
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
        if isinstance(cmd, AddGroup) and grammar_of(cmd.admission) is not None:
            try:
                compile_grammar(loop.engine, cmd.admission)
            except Exception as e:
                cmd.refused = add_error(e)  # the sink's `added` makes it portable
        loop.submit(cmd)
