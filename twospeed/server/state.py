"""ServerState: what every route shares (the engine thread, tokenizer, metrics, lanes, the worker pool, the
open requests, the draining flag), handed to routes as one FastAPI dependency; admission (lane, queue bound,
the engine's own checks); and the shutdown's word: past the grace, every open request is ended with an error.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from functools import lru_cache
from typing import Annotated

from fastapi import Depends, Request

from twospeed.config import EngineConfig
from twospeed.serving.async_engine import AsyncEngine, monotonic_to_unix
from twospeed.server.config import ServerConfig
from twospeed.serving.engine_client import EngineClient
from twospeed.serving.engine_spawn import EngineSpawn
from twospeed.serving.process_engine import ProcessEngine
from twospeed.server.errors import APIError
from twospeed.server.history import History
from twospeed.server.metrics import ServerMetrics
from twospeed.server.prepare import Preparer
from twospeed.serving.request_group import Admission, EngineGone, RequestGroup, SequenceSpec, ShutdownError
from twospeed.schema.slo import DEFAULT_LANE, SLOTable, Verdict
from twospeed.server.workers import WorkerPool

LANE_HEADER = "x-twospeed-lane"


class ServerState:
    """What the handlers share: the engine wrapper, the tokenizer, metrics, lanes, the draining flag."""

    def __init__(self, engine, server_config: ServerConfig, model_name: str, client: EngineClient | None = None):
        """engine: an LLMEngine, or a builder that start() runs in the engine thread (AsyncEngine says why), or an
        EngineConfig: the engine is built and stepped in a process of its own (serving/process_engine.py), or that
        process already started (an EngineSpawn).
        client: another EngineClient to serve with instead (engine_client.py; the cluster's router over replicas),
        which then owns the metrics and history its /metrics and /dashboard show."""
        self.engine = None  # the engine's read-only facts once started (an LLMEngine here): config, tokenizer
        self.tokenizer = None
        self.memory = None  # the engine's EngineMemory once started (weight and KV formats, pool size)
        self.config = server_config
        self.model_name = model_name
        self.slos = SLOTable(server_config.lanes())
        self.metrics = ServerMetrics(model_name, lanes=(DEFAULT_LANE, *self.slos.lanes))
        self.history = History(server_config.history())
        listeners = [self.metrics.on_event, self.history.on_event]
        if client is not None:
            self.async_engine: EngineClient = client
        elif isinstance(engine, (EngineConfig, EngineSpawn)):
            self.async_engine = ProcessEngine(engine, judge=self._judge, listeners=listeners,
                                              nice=server_config.engine_nice)
        else:
            self.async_engine = AsyncEngine(engine, judge=self._judge, listeners=listeners)
        self.to_unix = monotonic_to_unix()
        self.draining = False
        self.created = int(time.time())
        self.workers: WorkerPool | None = None
        self.prepare = Preparer(self)
        self.open_groups: set[RequestGroup] = set()  # admitted, their response not yet finished
        self.kv_bytes_per_block = 0  # bytes of K and V one block holds, once the engine is built
        self._decode_one = lru_cache(maxsize=65536)(self._decode_token)

    async def start(self) -> None:
        self.workers = WorkerPool(self.config.prep_threads)
        self.async_engine.start()
        self.engine = await self.async_engine.ready()
        self.tokenizer = self.engine.tokenizer
        self.memory = self.engine.memory()  # weight and KV formats, the pool in its format's bytes
        self.kv_bytes_per_block = self.memory.block_bytes
        self.metrics.set_pool(self.engine.num_blocks, self.kv_bytes_per_block, self.price_per_m())
        self.metrics.set_memory(self.memory)
        if self.engine.config.spec.enabled:
            self.metrics.set_spec(self.engine.config.spec.num_speculative_tokens)
        # The model, torch and the libraries are loaded for good: take them out of the cyclic GC's reach. Without
        # this a full collection walks them all, holding the GIL for 0.25-0.4 s on the demo model when a big
        # request allocates enough to trigger one (the event loop and the engine thread both stall); vLLM does
        # the same after its startup.
        gc.freeze()

    def price_per_m(self) -> dict[str, float]:
        """The --price table: dollars per 1M tokens by kind (input = prefilled, cached_input, output)."""
        price = self.config.price_table()
        return {"input": price.input_per_m, "cached_input": price.cached_input_per_m, "output": price.output_per_m}

    async def stop(self) -> None:
        self.draining = True
        self.end_open_requests()
        await self.async_engine.shutdown()
        if self.workers is not None:
            self.workers.close()

    async def run(self, fn, *args):
        """fn(*args) in a worker thread (parse, render, tokenize, compile: never on the event loop)."""
        return await self.workers.run(fn, *args)

    # -- shutdown -------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """SIGTERM: refuse new work now; in-flight requests have shutdown_grace seconds, then end with an error."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(self.config.shutdown_grace, self.end_open_requests)

    def end_open_requests(self) -> None:
        """Every open request gets its end now: an error event and [DONE] for a stream, a 503 otherwise."""
        message = f"the server shut down before this request finished (shutdown grace {self.config.shutdown_grace:g} s)"
        for group in list(self.open_groups):
            group.close(ShutdownError(message))
            self.async_engine.abort(group)

    def release(self, group: RequestGroup) -> None:
        """The group's response is over (done, client gone, shutdown): abort what is left of it."""
        self.open_groups.discard(group)
        self.async_engine.abort(group)

    def _judge(self, lane: str, request) -> Verdict:
        return self.slos.judge(lane, request.clock, request.bill, request.num_preemptions)

    def _decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling when there is no tokenizer
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._decode_one(token_id)

    # -- admission ------------------------------------------------------------------------------
    async def submit(self, body, request: Request, specs: list[SequenceSpec]) -> RequestGroup:
        """Admission (lane, queue bound) and the engine's own validation; returns the running group, open until
        release()."""
        lane_name = body.lane if body.lane is not None else request.headers.get(LANE_HEADER)
        overflowed = self.slos.overflowed
        try:
            lane = self.slos.admit(lane_name)
        except ValueError as e:
            raise APIError(400, str(e), param="lane") from None
        if self.slos.overflowed != overflowed:
            self.metrics.lane_overflow.labels(self.metrics.model).inc()
        self.metrics.add_lane(lane.lane)
        engine = self.async_engine
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        limit = self.config.max_waiting
        if len(specs) > limit:
            raise APIError(400, f"this request asks for {len(specs)} sequences (prompts x n) but at most {limit} "
                                f"may wait (--max-waiting)", param="n")
        if engine.num_waiting + len(specs) > limit:
            # A rough wait: the excess over the bound, drained a running batch at a time, at least a second.
            seats = self.engine.scheduler_config.max_num_seqs
            retry = max(1, math.ceil((engine.num_waiting + len(specs) - limit) / seats))
            raise APIError(429, f"the server is at capacity: {engine.num_waiting} sequences waiting "
                                f"(--max-waiting {limit}); retry later", "rate_limit_exceeded",
                           code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
        priority = body.priority if body.priority is not None else (lane.priority or 0)
        group = RequestGroup(Admission(lane.lane, priority, time.monotonic(), specs, itl_target=lane.itl_target,
                                       speculate=lane.speculate))
        if body.stream:  # a stream's undelivered output is bounded; past it the client is taken as gone
            group.max_backlog = self.config.max_stream_backlog
            group.on_backlog = lambda: engine.abort(group)
        try:
            await engine.add(group)
        except EngineGone as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except ValueError as e:  # admission's InvalidParam names its field ("structured": the body's own name)
            param = getattr(e, "param", None)
            raise APIError(400, str(e), param=body.structured_param if param == "structured" else param) from None
        except RuntimeError as e:
            raise APIError(400, f"the engine refused this request: {e}") from None
        self.open_groups.add(group)
        return group


def get_state(request: Request) -> ServerState:
    """The app's ServerState; 503 while the model is still loading."""
    state = getattr(request.app.state, "twospeed", None)
    if state is None:
        raise APIError(503, "the model is still loading", "service_unavailable")
    return state


State = Annotated[ServerState, Depends(get_state)]
