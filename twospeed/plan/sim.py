"""The planner's discrete-event simulator: the engine's own scheduler and KV cache, a cost model for the runner.

Each simulated replica is a `Scheduler` over a `KVCacheManager` (engine/scheduler.py and kv_cache.py, unchanged)
whose clock the simulator sets. A step is what `LLMEngine.step()` does, less the model: schedule; the step takes
the seconds a `StepTimer` gives (a cost model's prediction for the step's shape, or a live run's measured steps
replayed); then `update_after_step`, one output token per sampling chunk stamped at the step's end, the engine's
stop policy (engine/stop.py), and the scheduler's cost model learns the step as the engine's does (a fixed
profile only records its error). A request that arrives during a step waits for the next one, as in the engine
thread. Output tokens are the ones a request brings (a job's synthetic answer) or filler ids, and generation is
EOS-free: each request runs to its max_tokens, as `twospeed bench --ignore-eos` asks of the live engine. A
request the server would refuse (prompt plus max_tokens over max_model_len: its default `--max-tokens-policy
error`) ends at once with that error.

Topologies: `replicas` colocated engines behind a least-loaded router, or disaggregated pools (DistServe): P
prefill replicas compute each prompt and its first token, the KV crosses a link (latency + bytes / bandwidth),
and the least-loaded of D decode replicas decodes the rest. A decode replica takes the KV as vLLM's KV connectors
hand it to their scheduler, as tokens already computed when the request is admitted: here as prefix-cache blocks
registered on arrival and held until admission (whole blocks; the tail of a partial last block, fewer than
block_size tokens, is computed again there and billed as recomputed). A transfer waits while the decode pool
has no room for it.

Inputs: `SimRequest`s (plan/sim_workload.py builds them from the lab's run plan) and callbacks at times (a job's
next call). Output: `SimRun`, every request's clock and bill as the engine stamps them and every step (its chunk
list: the bit-identical test holds it against the live engine's).
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from twospeed.config import SchedulerConfig
from twospeed.engine.cost_model import StepCostModel
from twospeed.engine.kv_cache import KVCacheManager
from twospeed.engine.request import Bill, Clock, Request
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.scheduler import Scheduler, SchedulerOutput
from twospeed.engine.stop import finish_if_stopped
from twospeed.engine.lazy_pool import LazyBlockPool

_END, _ARRIVE, _START = 0, 1, 2  # at one instant: a step ends, then arrivals are admitted, then the next starts


@dataclass(slots=True)
class SimConfig:
    """One simulated deployment: the engine's scheduler and KV pool per replica, and the replicas."""

    scheduler: SchedulerConfig  # as the engine resolves it (max_model_len set)
    num_blocks: int  # KV blocks per replica
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True
    replicas: int = 1  # colocated engines (when prefill_replicas is 0)
    prefill_replicas: int = 0  # disaggregated: replicas that only prefill (0: colocated)
    decode_replicas: int = 0  # disaggregated: replicas that only decode
    kv_bytes_per_token: int = 0  # bytes of K and V per token (every layer): what a transfer carries
    link_bandwidth: float = 0.0  # bytes/s between the prefill and decode pools
    link_latency_s: float = 0.0  # seconds added to every transfer
    vocab_size: int = 32000  # filler output ids are drawn below this

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.replicas < 1:
            raise ValueError("num_blocks, block_size and replicas must be >= 1")
        if self.scheduler.max_model_len is None:
            raise ValueError("the simulator needs the scheduler's max_model_len resolved (as LLMEngine does)")
        if self.disaggregated:
            if self.prefill_replicas < 1 or self.decode_replicas < 1:
                raise ValueError("disaggregated pools need >= 1 prefill and >= 1 decode replica")
            if not self.link_bandwidth > 0 or self.kv_bytes_per_token < 1:
                raise ValueError("disaggregated pools need a link bandwidth (bytes/s) and the KV bytes per token")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0 or self.decode_replicas > 0

    @property
    def num_replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas if self.disaggregated else self.replicas


class StepTimer(Protocol):
    """How long a simulated step takes, and when the next one starts."""

    def seconds(self, out: SchedulerOutput) -> float: ...

    def next_start(self, t: float, after_step: bool) -> float:
        """When a step asked for at t starts: right after the last one ended (after_step) or on a wake-up."""
        ...


class ModelTimer:
    """A step takes what a cost model predicts for its shape, times lognormal noise of `noise` (0: none); the next
    starts `gap_s` after it (the host's time between back-to-back steps), or at once when an arrival wakes it."""

    def __init__(self, model: StepCostModel, noise: float = 0.0, seed: int = 0, gap_s: float = 0.0):
        self.model, self.noise, self.gap_s = model, noise, gap_s
        self.rng = np.random.default_rng(seed)

    def seconds(self, out: SchedulerOutput) -> float:
        t = self.model.predict(out.shape)
        return t * math.exp(self.noise * self.rng.standard_normal()) if self.noise else t

    def next_start(self, t: float, after_step: bool) -> float:
        return t + self.gap_s if after_step else t


class ReplayTimer:
    """A live run's steps replayed: step k starts at starts[k] (seconds on the simulation's clock) and takes
    seconds[k], what the engine measured and its cost model learnt."""

    def __init__(self, starts: list[float], seconds: list[float]):
        if len(starts) != len(seconds):
            raise ValueError("a start for every step")
        self.starts, self.steps, self.k = list(starts), list(seconds), 0

    def seconds(self, out: SchedulerOutput) -> float:
        if self.k >= len(self.steps):
            raise IndexError(f"the replay has {len(self.steps)} steps; the simulation asked for more")
        self.k += 1
        return self.steps[self.k - 1]

    def next_start(self, t: float, after_step: bool) -> float:
        return max(t, self.starts[self.k]) if self.k < len(self.starts) else t


@dataclass(slots=True)
class SimRequest:
    """One model call. The caller fills the first fields; the simulator the rest."""

    request_id: str
    lane: str
    arrival: float  # seconds since the run started, when the engine receives it
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] | None = None  # the tokens it produces (None: filler ids)
    itl_target: float | None = None  # seconds: its lane's ITL objective sizing the steps (Request.itl_target)
    priority: int = 0
    affinity: str | None = None  # requests with the same key go where the first went (a job's calls: its cache)
    tag: Any = None  # the caller's own (the lab's Planned, a job's call)
    clock: Clock | None = None  # as the engine stamps it; disaggregated: prefill's, then decode's tokens
    bill: Bill | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    error: str | None = None  # refused, as the server would (HTTP 400), or never scheduled
    replica: int | None = None  # where it ran (disaggregated: its decode replica)
    transfer_s: float | None = None  # disaggregated: seconds its KV spent on the link


@dataclass(slots=True)
class SimStep:
    """One simulated step (the engine's StepStats, plus the chunk list)."""

    replica: int
    start: float
    seconds: float
    chunks: list[tuple[str, int, int]]  # (request id, start, num_tokens), in the scheduler's order
    prefill_tokens: int
    decode_tokens: int
    preempted: list[str]
    kv_blocks_used: int
    predicted: float | None  # what the scheduler's cost model predicted
    target: float | None  # the step target the prompt share was sized to


@dataclass(slots=True)
class SimRun:
    requests: list[SimRequest]
    steps: list[SimStep]
    end: float  # seconds: the last step's end
    peak_kv_blocks: list[int]  # per replica: the most blocks in use at once
    cached_blocks: list[int]  # per replica: blocks holding a cached prefix at the end
    config: SimConfig


class Replica:
    """One engine: scheduler, KV pool, cost model and timer; `role` both, prefill or decode."""

    def __init__(self, index: int, role: str, cfg: SimConfig, cost_model: StepCostModel, timer: StepTimer):
        self.index, self.role, self.timer, self.cost_model = index, role, timer, cost_model
        caching = cfg.enable_prefix_caching or role == "decode"
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, caching, pool=LazyBlockPool(cfg.num_blocks, caching))
        self.now = 0.0
        self.scheduler = Scheduler(cfg.scheduler, self.kv, clock=lambda: self.now, cost_model=cost_model)
        self.in_flight: SchedulerOutput | None = None
        self.queued = False  # a step start is on the event heap
        self.peak = 0
        self.holders: dict[str, str] = {}  # request id -> the transfer holding its KV until admission
        self.transfers: list[tuple[SimRequest, Request]] = []  # waiting for room in this pool

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished + len(self.transfers)


class Simulator:
    """Runs SimRequests through replicas; `call_at` schedules a callback (a job's next call), `on_finish` hears
    every request that ends."""

    def __init__(self, cfg: SimConfig, cost_model: Callable[[], StepCostModel],
                 timer: Callable[[StepCostModel], StepTimer] = ModelTimer,
                 on_finish: Callable[[SimRequest, float], None] | None = None):
        self.cfg = cfg
        roles = (["prefill"] * cfg.prefill_replicas + ["decode"] * cfg.decode_replicas if cfg.disaggregated
                 else ["both"] * cfg.replicas)
        self.replicas = []
        for i, role in enumerate(roles):
            model = cost_model()
            self.replicas.append(Replica(i, role, cfg, model, timer(model)))
        self.on_finish = on_finish
        self._events: list = []
        self._seq = itertools.count()
        self.requests: dict[str, SimRequest] = {}
        self._affinity: dict[tuple[str, str], Replica] = {}
        self.steps: list[SimStep] = []
        self.end = 0.0

    # -- events -------------------------------------------------------------------------------------
    def _at(self, t: float, order: int, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, order, next(self._seq), fn))

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        self._at(t, _ARRIVE, fn)

    def submit(self, req: SimRequest) -> None:
        """The request reaches the engine at req.arrival."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._at(req.arrival, _ARRIVE, lambda t: self._arrive(req, t))

    def run(self) -> SimRun:
        while self._events:
            t, _, _, fn = heapq.heappop(self._events)
            fn(t)
        for req in self.requests.values():
            if req.clock is None and req.error is None:
                req.error = "never scheduled: the KV pool cannot hold it beside the others"
        return SimRun(list(self.requests.values()), self.steps, self.end, [r.peak for r in self.replicas],
                      [r.kv.num_cached_blocks for r in self.replicas], self.cfg)

    # -- requests -----------------------------------------------------------------------------------
    def _pick(self, role: str, req: SimRequest) -> Replica:
        """The replica its affinity key went to, else the least loaded (fewest unfinished requests) of those that
        take this role, lowest index on ties."""
        key = (role, req.affinity) if req.affinity is not None else None
        if key in self._affinity:
            return self._affinity[key]
        rep = min((r for r in self.replicas if r.role in (role, "both")), key=lambda r: (r.load, r.index))
        if key is not None:
            self._affinity[key] = rep
        return rep

    def _arrive(self, req: SimRequest, t: float) -> None:
        limit = self.cfg.scheduler.max_model_len
        if len(req.prompt_ids) + req.max_tokens > limit or not req.prompt_ids or req.max_tokens < 1:
            req.error = (f"HTTP 400: prompt ({len(req.prompt_ids)} tokens) plus max_tokens ({req.max_tokens}) is "
                         f"over max_model_len {limit}")
            self._done(req, t)
            return
        rep = self._pick("prefill" if self.cfg.disaggregated else "both", req)
        first_only = rep.role == "prefill"
        engine_req = _engine_request(req, t, 1 if first_only else req.max_tokens)
        req.replica = rep.index
        rep.scheduler.add_request(engine_req)
        self._wake(rep, t)

    def _wake(self, rep: Replica, t: float) -> None:
        if rep.in_flight is None and not rep.queued:
            rep.queued = True
            self._at(rep.timer.next_start(t, False), _START, lambda now: self._start(rep, now))

    def _token(self, req: SimRequest, position: int) -> int:
        """The request's own output id, else filler: deterministic per (request, position), never shared."""
        if req.output_ids is not None and position < len(req.output_ids):
            return req.output_ids[position]
        return 3 + zlib.crc32(f"{req.request_id}:{position}".encode()) % max(1, self.cfg.vocab_size - 3)

    # -- steps --------------------------------------------------------------------------------------
    def _start(self, rep: Replica, t: float) -> None:
        rep.queued = False
        rep.now = t
        out = rep.scheduler.schedule()
        for rid, holder in list(rep.holders.items()):  # admitted: the request holds its transferred blocks now
            if rid not in rep.scheduler.requests or rep.scheduler.requests[rid] not in rep.scheduler.waiting:
                rep.kv.free(holder)
                del rep.holders[rid]
        if not out.chunks:
            return  # nothing fits now; the next arrival or transfer wakes it
        seconds = rep.timer.seconds(out)
        used = rep.kv.num_blocks - rep.kv.num_free_blocks
        rep.peak = max(rep.peak, used)
        self.steps.append(SimStep(rep.index, t, seconds, [(c.request.request_id, c.start, c.num_tokens)
                                                          for c in out.chunks],
                                  out.num_prefill_tokens, out.num_decode_tokens,
                                  [r.request_id for r in out.preempted], used, out.predicted_time, out.target_time))
        rep.in_flight = out
        self._at(t + seconds, _END, lambda now: self._end(rep, out, seconds, now))

    def _end(self, rep: Replica, out: SchedulerOutput, seconds: float, t: float) -> None:
        rep.now = t
        self.end = max(self.end, t)
        rep.scheduler.update_after_step(out, t)
        for chunk in out.chunks:
            engine_req = chunk.request
            if not chunk.samples or engine_req.is_finished:
                continue
            req = self.requests[engine_req.request_id]
            engine_req.append_token(self._token(req, len(engine_req.output_token_ids)), t)
            if finish_if_stopped(rep.scheduler, engine_req, engine_req.output_token_ids[-1:]):
                self._finished(rep, req, engine_req, t)
        _learn(rep.cost_model, out, seconds)
        rep.in_flight = None
        self._retry_transfers(rep, t)
        if rep.scheduler.has_unfinished():
            rep.queued = True
            self._at(rep.timer.next_start(t, True), _START, lambda now: self._start(rep, now))

    def _finished(self, rep: Replica, req: SimRequest, engine_req: Request, t: float) -> None:
        if rep.role == "prefill" and req.max_tokens > 1:
            cfg = self.cfg
            seconds = cfg.link_latency_s + len(req.prompt_ids) * cfg.kv_bytes_per_token / cfg.link_bandwidth
            req.transfer_s = seconds
            self._at(t + seconds, _ARRIVE, lambda now: self._transferred(req, engine_req, now))
            return
        if rep.role == "decode":  # the clock was merged at the transfer; the bill adds the decode side's work
            req.bill.output_tokens = engine_req.bill.output_tokens
            req.bill.recomputed_tokens += engine_req.bill.prefilled_tokens + engine_req.bill.recomputed_tokens
        else:
            req.clock, req.bill = engine_req.clock, engine_req.bill
        req.finish_reason = engine_req.finish_reason
        req.num_preemptions += engine_req.num_preemptions
        self._done(req, t)

    def _done(self, req: SimRequest, t: float) -> None:
        if self.on_finish is not None:
            self.on_finish(req, t)

    # -- disaggregated: the KV crosses to a decode replica ---------------------------------------------
    def _transferred(self, req: SimRequest, prefilled: Request, t: float) -> None:
        rep = self._pick("decode", req)
        req.replica = rep.index
        rep.transfers.append((req, prefilled))
        self._retry_transfers(rep, t)

    def _retry_transfers(self, rep: Replica, t: float) -> None:
        while rep.transfers:
            req, prefilled = rep.transfers[0]
            engine_req = _engine_request(req, t, req.max_tokens)
            engine_req.append_token(prefilled.output_token_ids[0], prefilled.clock.first_token)
            holder = f"kv-transfer:{req.request_id}"
            if not rep.kv.allocate_slots(holder, engine_req.num_tokens):
                return  # no room in this pool yet: it waits (its blocks stay on the link side)
            rep.kv.cache_full_blocks(holder, engine_req.all_token_ids, engine_req.num_tokens)
            rep.transfers.pop(0)
            rep.holders[req.request_id] = holder
            req.clock, req.bill = _merged(prefilled, engine_req), prefilled.bill
            req.num_preemptions = prefilled.num_preemptions
            rep.scheduler.add_request(engine_req)
            self._wake(rep, t)


def _engine_request(req: SimRequest, t: float, max_output_tokens: int) -> Request:
    """The engine's Request for a SimRequest arriving at t (EOS-free: it runs to its max tokens)."""
    engine_req = Request(req.request_id, req.prompt_ids, SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
                         arrival_time=t, priority=req.priority, max_output_tokens=max_output_tokens)
    engine_req.itl_target = req.itl_target
    return engine_req


def _merged(prefilled: Request, decoding: Request) -> Clock:
    """The client's clock of a disaggregated request: the prefill replica's stamps, and the decode replica's token
    times (its list starts with the first token), which the decode side keeps filling in place."""
    clock = decoding.clock
    p = prefilled.clock
    clock.arrival, clock.first_scheduled, clock.prefill_done = p.arrival, p.first_scheduled, p.prefill_done
    return clock


def _learn(model: StepCostModel, out: SchedulerOutput, seconds: float) -> None:
    """As LLMEngine._learn_step: the cost model learns the step; each stream that shared it with a prompt chunk
    notes its length."""
    model.observe(out.shape, seconds)
    if out.num_prefill_tokens:
        for c in out.chunks:
            if c.is_decode:
                c.request.clock.longest_interfered_step = max(c.request.clock.longest_interfered_step, seconds)
