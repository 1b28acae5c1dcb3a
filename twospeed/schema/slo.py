"""Lanes and their SLOs: parse `--slo` flags or a YAML file, judge each finished request, name a miss's cause.

A lane is a name a request carries (body field "lane" or header x-twospeed-lane; "default"
when it names none). A lane's SLO is a set of objectives, each a clock metric with an
optional percentile and a threshold:

    --slo drafting:ttft_p99=500ms,itl_p99=60ms --slo nightly:ttlt=30s,priority=5

Metrics (the split clock of docs/ARCHITECTURE.md): queue, prefill, ttft, itl, tpot, ttlt. Units: us, ms, s, m.
`priority=N` sets the lane's scheduling priority (used with --scheduling-policy priority);
`speculate=off` turns speculative decoding off for the lane's requests (on: as the server is set).
A lane's tightest ITL objective also goes to the engine with each of its requests: while one of them decodes,
the scheduler keeps each step's predicted time within it (x SchedulerConfig.itl_objective_share).

Judging one request: for queue/prefill/ttft/tpot/ttlt the request's own value is compared
with the threshold (the percentile says what share of the lane's requests may miss: p99 ->
1%, which a dashboard reads off twospeed_slo_requests_total); for itl the request's own
percentile of its token gaps is compared (itl_p99: its p99 gap; itl with no percentile:
its largest gap). An objective whose value the request does not have (tpot of a
one-token answer) is skipped.

A miss is attributed to one main cause, in this order:
  preemption            the request was preempted (its KV dropped and recomputed);
  then by the objective it missed worst (value / threshold):
  queue, prefill        that phase, or for ttft the larger of the two;
  decode_interference   a decode-side miss (itl, tpot, or a ttlt dominated by decode) where
                        at least as many of its decode steps shared the batch with another
                        request's prefill chunk (clock.interfered_steps) as there were slow gaps;
  decode                a decode-side miss that interference does not explain (a big batch,
                        a slow machine).
No torch and no HTTP here: the async engine calls `judge` when a request finishes.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from twospeed.schema.clock import Bill, Clock, percentile

log = logging.getLogger(__name__)

METRICS = ("queue", "prefill", "ttft", "itl", "tpot", "ttlt")
CAUSES = ("queue", "prefill", "decode_interference", "decode", "preemption")
DEFAULT_LANE = "default"
_LANE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_KEY_RE = re.compile(r"^(?P<metric>[a-z]+)(?:_p(?P<p>\d+(?:\.\d+)?))?$")
_VALUE_RE = re.compile(r"^(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(?P<unit>us|ms|s|m)$")


@dataclass(frozen=True, slots=True)
class Objective:
    metric: str  # one of METRICS
    threshold: float  # seconds
    percentile: float | None = None  # e.g. 99.0; None: every request (itl: the largest gap)

    @property
    def name(self) -> str:
        return self.metric if self.percentile is None else f"{self.metric}_p{self.percentile:g}"

    def value(self, clock: Clock) -> float | None:
        """The request's own value for this objective, in seconds (None if it has none), from the server's clock."""
        return self.measure(clock.itl, queue=clock.queue_time, prefill=clock.prefill_time, ttft=clock.ttft,
                            tpot=clock.tpot, ttlt=clock.ttlt)

    def measure(self, itl: Sequence[float] = (), **seconds: float | None) -> float | None:
        """The same value from what was measured, wherever (the lab's client stream has no server clock): `itl`
        the request's token gaps, `seconds` the other metrics by name; a metric not given has no value."""
        if self.metric == "itl":
            gaps = sorted(itl)
            if not gaps:
                return None
            return gaps[-1] if self.percentile is None else percentile(gaps, self.percentile)
        return seconds.get(self.metric)


@dataclass(frozen=True, slots=True)
class LaneSLO:
    """A lane's objectives, however they were given (`--slo`, an SLO file, a workload's `slo:`), and the one judge
    the server, the lab and the planner all use."""

    lane: str
    objectives: tuple[Objective, ...] = ()
    priority: int | None = None  # scheduling priority for the lane's requests (lower runs first)
    speculate: bool | None = None  # False: the lane's requests never speculate (None: as the engine is set)
    # the share of the lane's requests that must meet every objective; None: the tightest percentile's (p99: 0.99),
    # every request when no objective has a percentile
    target: float | None = None

    @classmethod
    def from_workload(cls, lane: str, value: dict | None) -> LaneSLO:
        """A workload lane's `slo:` (ttft_p99_ms, itl_p99_ms, completion_window_s, target; target 0.99 unless
        given), the lab's YAML vocabulary for the same objectives."""
        value = dict(value or {})
        unknown = set(value) - set(WORKLOAD_KEYS)
        if unknown:
            raise ValueError(f"unknown SLO keys {sorted(unknown)}; expected {sorted(WORKLOAD_KEYS)}")
        return cls(lane, workload_objectives(value), target=float(value.get("target", 0.99)))

    def workload_dict(self) -> dict:
        """The objectives in the workload's vocabulary, as results.json records a lane's SLO."""
        out = {"ttft_p99_ms": None, "itl_p99_ms": None, "completion_window_s": None}
        for o in self.objectives:
            if o.metric in ("ttft", "itl") and o.percentile == 99.0:
                out[f"{o.metric}_p99_ms"] = o.threshold * 1e3
            elif o.metric == "ttlt" and o.percentile is None:
                out["completion_window_s"] = o.threshold
        return {**out, "target": self.attainment_target}

    @property
    def attainment_target(self) -> float:
        if self.target is not None:
            return self.target
        shares = [o.percentile / 100 for o in self.objectives if o.percentile is not None]
        return max(shares) if shares else 1.0

    def misses(self, value: Callable[[Objective], float | None]) -> list[tuple[float, Objective]]:
        """The objectives a request missed, each with how far (value / threshold); an objective the request has no
        value for (tpot of a one-token answer) is skipped. `value` reads the request: `Objective.value` on the
        server's clock, or `Objective.measure` on what a client timed."""
        return [(v / o.threshold, o) for o in self.objectives if (v := value(o)) is not None and v > o.threshold]

    def judge(self, clock: Clock, bill: Bill, num_preemptions: int) -> Verdict:
        """One finished request against this lane's objectives, a miss attributed to its main cause."""
        misses = self.misses(lambda o: o.value(clock))
        if not misses:
            return Verdict(self.lane, True)
        worst = max(misses, key=lambda m: m[0])[1]
        return Verdict(self.lane, False, attribute(worst, clock, bill, num_preemptions), [o.name for _, o in misses])

    @property
    def itl_target(self) -> float | None:
        """Seconds: the lane's tightest ITL objective, which the scheduler sizes steps to while the lane's requests
        decode (Request.itl_target); inf when it has objectives but none on ITL; None without any."""
        if not self.objectives:
            return None
        return min((o.threshold for o in self.objectives if o.metric == "itl"), default=math.inf)


@dataclass(slots=True)
class Verdict:
    """One finished request judged against its lane's SLO."""

    lane: str
    met: bool
    cause: str | None = None  # one of CAUSES when missed
    missed: list[str] = field(default_factory=list)  # objective names missed, e.g. ["ttft_p99"]

    def as_dict(self) -> dict:
        return {"lane": self.lane, "met": self.met, "cause": self.cause, "missed": list(self.missed)}


def check_lane_name(lane: str) -> str:
    if not isinstance(lane, str) or not _LANE_RE.match(lane):
        raise ValueError(f"lane names are 1-64 characters of letters, digits, '_', '.', '-'; got {lane!r}")
    return lane


def parse_duration(text: str) -> float:
    """'500ms' -> 0.5 (seconds). A unit is required: a bare number is ambiguous."""
    m = _VALUE_RE.match(text.strip())
    if not m:
        raise ValueError(f"expected a duration with a unit (us, ms, s, m), e.g. 500ms; got {text!r}")
    value = float(m["num"]) * _UNITS[m["unit"]]
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"durations must be positive, got {text!r}")
    return value


# A workload's `slo:` keys: the same objectives in milliseconds and seconds, always at p99 (the lab's vocabulary)
WORKLOAD_KEYS = ("ttft_p99_ms", "itl_p99_ms", "completion_window_s", "target")


def workload_objectives(value: dict) -> tuple[Objective, ...]:
    """The objectives a workload's `slo:` (or results.json's record of one) states; other keys are ignored."""
    out = []
    if value.get("ttft_p99_ms") is not None:
        out.append(Objective("ttft", float(value["ttft_p99_ms"]) / 1e3, 99.0))
    if value.get("itl_p99_ms") is not None:
        out.append(Objective("itl", float(value["itl_p99_ms"]) / 1e3, 99.0))
    if value.get("completion_window_s") is not None:
        out.append(Objective("ttlt", float(value["completion_window_s"])))
    return tuple(out)


def _parse_items(lane: str, items: dict[str, object]) -> LaneSLO:
    check_lane_name(lane)
    objectives, priority, speculate = [], None, None
    for key, raw in items.items():
        key = str(key).strip()
        if key == "speculate":
            flag = str(raw).strip().lower()
            if flag not in ("on", "off", "true", "false"):
                raise ValueError(f"lane {lane!r}: speculate must be on or off, got {raw!r}")
            speculate = flag in ("on", "true")
            continue
        if key == "priority":
            try:
                priority = int(str(raw).strip())
            except ValueError:
                raise ValueError(f"lane {lane!r}: priority must be an integer, got {raw!r}") from None
            continue
        m = _KEY_RE.match(key)
        if not m or m["metric"] not in METRICS:
            raise ValueError(f"lane {lane!r}: unknown objective {key!r}; use one of {', '.join(METRICS)} "
                             f"with an optional percentile, e.g. ttft_p99")
        p = float(m["p"]) if m["p"] else None
        if p is not None and not 0 < p <= 100:
            raise ValueError(f"lane {lane!r}: percentile in {key!r} must be in (0, 100]")
        objectives.append(Objective(m["metric"], parse_duration(str(raw)), p))
    return LaneSLO(lane, tuple(objectives), priority, speculate)


def parse_slo_flag(spec: str) -> LaneSLO:
    """'drafting:ttft_p99=500ms,itl_p99=60ms' -> LaneSLO."""
    lane, sep, rest = spec.partition(":")
    if not sep or not rest.strip():
        raise ValueError(f"--slo expects LANE:METRIC=DURATION[,...], e.g. drafting:ttft_p99=500ms; got {spec!r}")
    items = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"--slo {spec!r}: {part!r} is not METRIC=DURATION")
        items[key.strip()] = value.strip()
    return _parse_items(lane.strip(), items)


def load_slo_file(path: str | Path) -> list[LaneSLO]:
    """A YAML file: `lanes: {drafting: {ttft_p99: 500ms, itl_p99: 60ms}, nightly: {ttlt: 30s}}`
    (the top-level `lanes:` key may be left out)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if isinstance(data, dict) and "lanes" in data:
        data = data["lanes"]
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: expected a mapping of lane name -> {{objective: duration}}")
    return [_parse_items(str(lane), items) for lane, items in data.items()]


class SLOTable:
    """The configured lanes; a lane without an SLO is accepted (every request meets an empty SLO)."""

    def __init__(self, lanes: list[LaneSLO] = (), max_lanes: int = 16):
        self.lanes: dict[str, LaneSLO] = {}
        for slo in lanes:
            if slo.lane in self.lanes:
                raise ValueError(f"lane {slo.lane!r} is given twice")
            self.lanes[slo.lane] = slo
        # lanes named by requests alone (not configured, not default): bounds the label sets /metrics grows to
        self.max_lanes = max_lanes
        self._seen: set[str] = {DEFAULT_LANE, *self.lanes}
        self._named: set[str] = set()
        self.overflowed = 0  # requests served under the default lane because their new lane was past the bound

    def admit(self, lane: str | None) -> LaneSLO:
        """The lane a request runs in; ValueError for a bad name. Past max_lanes names that no configuration
        gave, a new one runs in the default lane (counted, warned once): one client's made-up lanes can neither
        grow /metrics without bound nor refuse anyone's request, and configured lanes always keep their own."""
        lane = check_lane_name(DEFAULT_LANE if lane is None else lane)
        if lane not in self._seen:
            if len(self._named) >= self.max_lanes:
                if not self.overflowed:
                    log.warning("more than %d distinct lanes: requests in new lanes run in %r (counted in "
                                "twospeed_lane_overflow_total)", self.max_lanes, DEFAULT_LANE)
                self.overflowed += 1
                return self.lanes.get(DEFAULT_LANE) or LaneSLO(DEFAULT_LANE)
            self._seen.add(lane)
            self._named.add(lane)
        return self.lanes.get(lane) or LaneSLO(lane)

    def judge(self, lane: str, clock: Clock, bill: Bill, num_preemptions: int) -> Verdict:
        slo = self.lanes.get(lane)
        return Verdict(lane, True) if slo is None else slo.judge(clock, bill, num_preemptions)


def attribute(worst: Objective, clock: Clock, bill: Bill, num_preemptions: int) -> str:
    """The main cause of a miss (see the module docstring for the rule)."""
    if num_preemptions > 0 or bill.recomputed_tokens > 0:
        return "preemption"
    queue, prefill = clock.queue_time or 0.0, clock.prefill_time or 0.0
    metric = worst.metric
    if metric in ("queue", "prefill"):
        return metric
    if metric == "ttft":
        return "queue" if queue >= prefill else "prefill"
    if metric == "ttlt":
        decode = (clock.ttlt or 0.0) - queue - prefill
        if max(queue, prefill) >= decode:
            return "queue" if queue >= prefill else "prefill"
    gaps = clock.itl
    if metric == "itl":
        slow = sum(g > worst.threshold for g in gaps)
    else:  # tpot or a decode-dominated ttlt: gaps well above the request's own typical gap
        typical = percentile(sorted(gaps), 50) or 0.0
        slow = sum(g > 2 * typical for g in gaps)
    return "decode_interference" if clock.interfered_steps >= max(1, slow) else "decode"
