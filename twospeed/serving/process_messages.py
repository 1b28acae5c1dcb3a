"""The messages between the server and its engine process (process_engine.py's client, engine_child.py's child).

Server to engine: the engine's config first, then the EngineLoop's own commands (engine_loop.py: AddGroup with
its Admission, AbortSequences, AbortAll) and `StopEngine`. Engine to server: `Ready` (or `StartFailed`), then one
`Outbox` per pass of the loop, and `Stopped` last. All are pickled as they are; an error crosses as the exception
raised (`portable` makes sure it can).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from twospeed.serving.engine_loop import Command
from twospeed.serving.engine_view import EngineFacts
from twospeed.serving.events import EngineEvent
from twospeed.serving.request_group import StreamItem

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


ToEngine = Command | StopEngine
FromEngine = Ready | StartFailed | Outbox | Stopped


def portable(e: BaseException | None) -> BaseException | None:
    """The exception itself where it survives pickling (InvalidParam keeps its field), else a RuntimeError with its
    type and message: what crosses the pipe is always an exception the server can raise."""
    if e is None:
        return None
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
