"""EngineClient: what the routes need of an engine, whichever engine is behind them.

The routes and ServerState never step an engine themselves: they add a request group, read its items from the
group's queue, and abort it when its response ends. Two implementations:
- `AsyncEngine` (async_engine.py): the LLMEngine in a thread of this process (`twospeed serve`);
- `ClusterEngine` (twospeed/cluster/client.py): engine replicas on Ray Serve, picked per request by a router
  (`twospeed serve --replicas N`).

`ready()` returns the engine's read-only facts as an object with LLMEngine's read-only surface: `config`,
`tokenizer`, `limits`, `max_model_len`, `scheduler_config`, `num_blocks`, `eos_token_ids`. A request's grammar is
the client's to compile, once, beside its engine (engine_loop.compile_grammar).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from twospeed.serving.request_group import RequestGroup


@runtime_checkable
class EngineClient(Protocol):
    def start(self) -> None:
        """Begin starting (called on the event loop); ready() says when it is done."""

    async def ready(self) -> Any:
        """The engine's read-only facts once started (see the module docstring); raises why it could not start."""

    async def add(self, group: RequestGroup) -> None:
        """Admit every sequence of the group, or none: ValueError (InvalidParam names the field) when the engine
        refuses it, EngineGone when there is no engine to serve it. Its items (request_group.StreamItem) then arrive
        on group.queue."""

    def abort(self, group: RequestGroup) -> None:
        """Stop the group's unfinished sequences (idempotent, never blocks); their KV blocks go back."""

    @property
    def num_waiting(self) -> int:
        """Sequences admitted but not yet scheduled (the --max-waiting bound is checked against it)."""

    @property
    def is_alive(self) -> bool:
        """Whether new requests can be served (/health)."""

    async def shutdown(self) -> None:
        """Abort what is left and stop."""
