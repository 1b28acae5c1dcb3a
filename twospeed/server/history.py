"""History: the last minutes of the engine, in memory, for the dashboard (GET /dashboard/data).

An engine listener (serving/events.py), like the metrics. It keeps, each in a ring of fixed size:
- every engine step: the numeric fields of StepStats (tokens by kind, step time, running, waiting, preempted, KV
  blocks, and whatever numbers StepStats gains, e.g. the cost model's prediction), one column each;
- every inter-token gap of every finished sequence, with its lane (ITL percentiles and CDFs per lane);
- one record per ended sequence: its split clock, its bill (every field the Bill has), its SLO verdict;
and, since the start, per-lane totals of exactly what /metrics counts (FinishEvent.counts()) and the last
load (running and waiting per lane, KV usage, cached blocks), so the page's totals equal /metrics.

Memory is bounded by construction: the rings are preallocated arrays (ring.py) and the records a deque with a
maximum length, so `memory_cap` is known before the first request (a soak test holds it to that). Records
older than `minutes` are not served. Written by the engine thread, read by the event loop: one lock, held for
an append or a copy, never while building JSON.

Times served are Unix seconds. `since(t)` returns what was appended after t: a record is stamped when it is
appended (monotonic, under the lock), so polling with the previous reply's `now` misses nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from twospeed.engine.engine_stats import StepStats
from twospeed.engine.request import percentile
from twospeed.serving.events import EngineEvent, FinishEvent, LoadEvent, StepEvent
from twospeed.server.ring import ColumnRing

# StepStats fields that are not per-step series: the stamp, and the pool size (constant; served in the config).
_NOT_SERIES = {"time", "kv_blocks_total"}
RECORD_BYTES = 2600  # measured upper bound of one request record (a dict of ~30 small values), for memory_cap


@dataclass(slots=True)
class HistoryConfig:
    """How much the dashboard's history keeps."""

    minutes: float = 15.0  # how far back the page can look (older records are not served)
    max_steps: int = 65536  # engine steps kept (about 11 minutes at 100 steps/s)
    max_gaps: int = 262144  # inter-token gaps kept, all lanes together
    max_requests: int = 4096  # ended sequences kept with their clock and bill

    def __post_init__(self) -> None:
        if not self.minutes > 0 or min(self.max_steps, self.max_gaps, self.max_requests) < 1:
            raise ValueError("history minutes must be > 0 and its sizes >= 1")


def step_columns() -> tuple[str, ...]:
    """The per-step series: every int, float or bool field of StepStats but the stamp and the pool size."""
    numeric = {"int", "float", "bool", "float | None", "int | None"}
    return tuple(f.name for f in dataclasses.fields(StepStats)
                 if f.name not in _NOT_SERIES and getattr(f.type, "__name__", f.type) in numeric)


class History:
    def __init__(self, config: HistoryConfig | None = None, clock=time.monotonic):
        self.config = config or HistoryConfig()
        self._clock = clock
        self._to_unix = time.time() - time.monotonic() if clock is time.monotonic else 0.0
        self._lock = threading.Lock()
        self.step_columns = step_columns()
        self._steps = ColumnRing(self.step_columns, self.config.max_steps)
        self._gaps = ColumnRing(("lane", "gap"), self.config.max_gaps)
        self._requests: deque[tuple[float, dict]] = deque(maxlen=self.config.max_requests)
        self._lanes: list[str] = []  # lane index (the gap ring's lane column) -> name
        self._lane_index: dict[str, int] = {}
        self._totals: dict[str, Counter] = {}
        self._slo: dict[str, Counter] = {}  # lane -> Counter of "met" / a miss cause
        self._load: dict = {"running": {}, "waiting": {}, "kv_usage": 0.0, "cached_blocks": 0}
        self._last = 0.0  # the last stamp handed out (stamps never decrease)

    @property
    def memory_cap(self) -> int:
        """Bytes the history can hold at most: the rings (fixed) plus max_requests records."""
        return self._steps.nbytes + self._gaps.nbytes + self.config.max_requests * RECORD_BYTES

    def _stamp(self) -> float:
        self._last = max(self._last, self._clock())
        return self._last

    # -- engine thread ---------------------------------------------------------------------------
    def on_event(self, event: EngineEvent) -> None:
        match event:
            case StepEvent(stats):
                values = [getattr(stats, c) for c in self.step_columns]
                with self._lock:
                    self._steps.append(self._stamp(), values)
            case LoadEvent(running, waiting, kv_usage, cached_blocks):
                load = {"running": running, "waiting": waiting, "kv_usage": kv_usage, "cached_blocks": cached_blocks}
                with self._lock:
                    self._load = load
            case FinishEvent():
                self._on_finish(event)

    def _on_finish(self, event: FinishEvent) -> None:
        counts = event.counts()
        record = self._record(event, counts)
        gaps = [] if event.aborted else event.request.clock.itl
        with self._lock:
            stamp = self._stamp()
            lane = self._lane(event.lane)
            self._totals[event.lane].update({"sequences": 1, "aborted": int(event.aborted), **counts})
            if event.verdict is not None:
                self._slo[event.lane][event.verdict.cause or "met"] += 1
            for gap in gaps:
                self._gaps.append(stamp, (lane, gap))
            record["t"] = stamp + self._to_unix
            self._requests.append((stamp, record))

    def _lane(self, lane: str) -> int:
        if lane not in self._lane_index:
            self._lane_index[lane] = len(self._lanes)
            self._lanes.append(lane)
            self._totals[lane] = Counter()
            self._slo[lane] = Counter()
        return self._lane_index[lane]

    def _record(self, event: FinishEvent, counts: dict[str, int]) -> dict:
        """One ended sequence for the page's table: times in seconds, arrival in Unix seconds."""
        req, clock, verdict = event.request, event.request.clock, event.verdict
        itl = sorted(clock.itl)
        return {"id": req.request_id, "lane": event.lane, "arrival": clock.arrival + self._to_unix,
                "finish_reason": "abort" if event.aborted and req.finish_reason is None else req.finish_reason,
                "aborted": event.aborted, "queue": clock.queue_time, "route": clock.route_time,
                "prefill": clock.prefill_time,
                "ttft": clock.ttft, "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
                "itl_max": itl[-1] if itl else None, "tpot": clock.tpot, "ttlt": clock.ttlt,
                "decode_steps": clock.decode_steps, "interfered_steps": clock.interfered_steps,
                "preemptions": req.num_preemptions, "bill": counts,
                "met": None if verdict is None else verdict.met, "cause": None if verdict is None else verdict.cause,
                "missed": [] if verdict is None else list(verdict.missed)}

    # -- event loop ------------------------------------------------------------------------------
    def since(self, t: float | None = None) -> dict:
        """Everything appended after Unix time t (None or 0: all kept; negative: the last -t seconds), no older
        than `minutes`. Steps and gaps come column by column: {"t": [...], column: [...]}; NaN is None."""
        with self._lock:
            now = self._stamp()
            floor = now - self.config.minutes * 60
            if t is not None and t < 0:
                floor = max(floor, now + t)
            elif t:
                floor = max(floor, t - self._to_unix)
            step_t, step_cols = self._steps.since(floor)
            gap_t, (gap_lane, gap) = self._gaps.since(floor)
            requests = [r for s, r in self._requests if s > floor]
            lanes = list(self._lanes)
            totals = {lane: dict(c) for lane, c in self._totals.items()}
            slo = {lane: dict(c) for lane, c in self._slo.items()}
            load = dict(self._load)
        steps = {"t": [s + self._to_unix for s in step_t]}
        steps.update({name: _nan_to_none(col) for name, col in zip(self.step_columns, step_cols)})
        return {"now": now + self._to_unix, "window_s": self.config.minutes * 60, "lanes": lanes,
                "steps": steps, "gaps": {"t": [s + self._to_unix for s in gap_t],
                                         "lane": [lanes[int(i)] for i in gap_lane], "gap": gap},
                "requests": requests, "totals": totals, "slo": slo, "load": load}


def _nan_to_none(values: list[float]) -> list[float | None]:
    return [None if v != v else v for v in values]
