"""EngineReplica: one engine replica on Ray Serve — `twospeed serve` without the HTTP, behind the ingress.

Each replica is a Ray actor (a Ray Serve deployment of one replica, engine-0 .. engine-N-1) holding a headless
ServerState: the engine in a process of its own (ProcessEngine; a thread with engine_process off), the lanes'
SLOs judging every finished sequence, the Prometheus metrics and the dashboard's history as its listeners,
worker threads for grammar compiles. It sets its own torch/OpenMP threads before the engine is built.

The ingress calls:
- generate(Admission) -> a stream (over the replica's direct channel, channel.py, or Ray Serve's handle):
  Admitted or Refused, then Batches of Deltas (wire.py). The request's arrival is the ingress's (converted to
  this machine's clock), `routed` is its arrival here, so the clock's ttft is measured from the ingress and
  route_time is the hop. Cancelling the stream aborts the sequences.
- describe(), ping() (instance id, actor, load, where its channel listens), metrics() (the Prometheus text),
  history(since).
Ray Serve calls check_health() and restarts a replica whose engine died, or whose process did.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from functools import partial

from twospeed.cluster.channel import ChannelAddress, ChannelServer
from twospeed.config import EngineConfig
from twospeed.server.config import ServerConfig
from twospeed.serving.engine_view import EngineFacts
from twospeed.serving.events import EngineEvent, LoadEvent
from twospeed.serving.request_group import Admission, RequestGroup
from twospeed.server.state import ServerState
from twospeed.serving.wire import Admitted, Batch, Load, Refused, TimeBase, admission_from_wire, to_wire


class EngineReplica:
    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, name: str, threads: int):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        self.name = name
        self.instance = uuid.uuid4().hex[:12]
        self.base = TimeBase()
        self._kv_usage, self._cached_blocks = 0.0, 0
        model_name = server_config.served_model_name or engine_config.model
        # the engine in a process of its own (serving/process_engine.py): Ray's event loop here, which carries every
        # stream's messages, then never takes the GIL from a step (and this actor never imports torch)
        source = dataclasses.replace(engine_config, num_threads=engine_config.num_threads or threads)
        if not server_config.engine_process:
            source = _engine_builder(engine_config, threads)
        self.state = ServerState(source, server_config, model_name)
        self.state.async_engine.listeners.append(self._on_event)
        await self.state.start()
        self.channel = ChannelServer(self.generate)
        await self.channel.start(_node_ip())

    def _on_event(self, event: EngineEvent) -> None:
        if isinstance(event, LoadEvent):
            self._kv_usage, self._cached_blocks = event.kv_usage, event.cached_blocks

    def load(self) -> Load:
        engine = self.state.async_engine
        return Load(engine.num_waiting, engine.num_running, self._kv_usage, self._cached_blocks)

    # -- the ingress's calls --------------------------------------------------------------------
    async def generate(self, routed: Admission):
        admission, route_time = admission_from_wire(routed, self.base, time.monotonic())
        group = RequestGroup(admission, assemble=False)  # the ingress adds the deltas up
        state = self.state
        try:
            if state.draining:
                raise ValueError(f"replica {self.name} is shutting down")
            state.metrics.add_lane(admission.lane)
            await state.async_engine.add(group)
        except ValueError as e:
            yield Refused(str(e), getattr(e, "param", None))
            return
        except RuntimeError as e:
            yield Refused(f"the engine refused this request: {e}")
            return
        state.open_groups.add(group)
        try:
            yield Admitted(route_time, self.load())
            while not group.done:
                items = [await group.next()]
                while not group.done and not group.queue.empty():  # whatever else is ready goes in the same message
                    items.append(await group.next())
                yield Batch([to_wire(item, self.base) for item in items], self.load())
        finally:  # done, or cancelled by the ingress (the client left): abort what is left
            state.release(group)

    async def describe(self) -> EngineFacts:
        return EngineFacts.of(self.state.engine, self.name, self.instance, _actor_name())

    async def ping(self) -> tuple[str, str, Load, ChannelAddress | None]:
        return self.instance, _actor_name(), self.load(), self.channel.address

    async def metrics(self) -> str:
        return self.state.metrics.render().decode()

    async def history(self, since: float | None) -> dict:
        return self.state.history.since(since)

    def check_health(self) -> None:
        if not self.state.async_engine.is_alive:
            raise RuntimeError(f"replica {self.name}: the engine is not running")

    async def __del__(self):
        await self.channel.stop()
        await self.state.stop()


def _engine_builder(engine_config: EngineConfig, threads: int):
    """The engine built in a thread of this actor (engine_process off), computing with `threads` threads."""
    import torch

    from twospeed.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    return partial(LLMEngine, engine_config)


def _node_ip() -> str:
    """The address the ingress reaches this node at (Ray's own: loopback for a cluster kept on one machine)."""
    import ray

    return ray.util.get_node_ip_address()


def _actor_name() -> str:
    import ray

    return ray.get_runtime_context().get_actor_name() or ""
