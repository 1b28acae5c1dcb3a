"""A small pool of daemon threads for the work a request needs before the engine sees it.

Parsing a large body, rendering a chat template, tokenizing, checking a schema and compiling its grammar
all take from milliseconds to seconds; on the event loop they would stall every other request and
/health. Here they run beside it: `tokenizers` and llguidance release the GIL while they work, and
Python-level work (jinja, jsonschema) hands it back every switch interval.

Daemon threads, unlike concurrent.futures' (which the interpreter joins at exit), so a shutdown never
waits for a tokenization nobody will read.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from twospeed.serving.request_group import resolve_future

T = TypeVar("T")


class WorkerPool:
    def __init__(self, num_threads: int = 2, name: str = "twospeed-prep"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker thread; its result or its exception, back on the event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return await future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            if future.cancelled():  # the client left before its turn
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the awaiting handler, never lost
                result, error = None, e
            try:
                loop.call_soon_threadsafe(resolve_future, future, error, result)
            except RuntimeError:  # the loop is closed: the server is gone
                return

