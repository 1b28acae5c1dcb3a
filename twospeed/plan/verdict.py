"""Did a simulated run meet every lane's SLO, and if not, which lane binds and which speed it lacked.

A lane's goal is its LaneSLO (schema/slo.py): objectives over the split clock (`Objective`: ttft, itl, ttlt, queue,
prefill, tpot, each with an optional percentile) and the share of its requests that must meet all of them (0.99
for p99 objectives, as the lab's SLO target). Each finished request is judged on its own values, exactly as the
lab and the server judge one (itl_p99: the request's own p99 gap); a request that failed misses. The lane is met
when its attainment reaches the target. A miss has one cause (schema/slo.py's `attribute`: queue, prefill,
decode_interference, decode, preemption) and the causes map to the speed that ran short:

  queue                the replica could not start it: prompts' compute is saturated (prefill speed, capacity)
  prefill              its own prompt's compute (prefill speed)
  decode_interference  prompt chunks inside its decode steps (the step budget)
  decode               decode steps too slow for its ITL (decode speed: bandwidth)
  preemption           its KV was dropped (KV capacity)

The binding lane is the one furthest below its target; with all met, the one with the least margin.

A finite run can meet every goal at a rate no replica sustains (a burst that fits one batch), so a run also has to
keep up: the queue time of the last quarter of its arrivals (p90) may not exceed three times the first quarter's
plus a floor (half the tightest TTFT objective, else 0.5 s: a queue that long and still growing would miss it
in a longer run). A run that fails this is not met, and its
binding cause is "backlog": arrivals outpace the replica.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from twospeed.schema.clock import Bill
from twospeed.plan.sim import SimRequest
from twospeed.schema.slo import LaneSLO

SPEED = {"queue": "prefill (compute: prompts queue for the replica)", "prefill": "prefill (compute: the prompt itself)",
         "decode_interference": "decode (prompt chunks inside decode steps: the step budget)",
         "decode": "decode (memory bandwidth: each step's weights and KV)",
         "preemption": "KV capacity (requests preempted and recomputed)", "error": "refused (over max_model_len)",
         "backlog": "throughput (the queue grows: arrivals outpace the replica)"}


@dataclass(slots=True)
class LaneVerdict:
    lane: str
    requests: int
    met_requests: int
    target: float
    causes: Counter = field(default_factory=Counter)  # misses by cause
    missed_objectives: Counter = field(default_factory=Counter)  # misses by objective name

    @property
    def attainment(self) -> float:
        return self.met_requests / self.requests if self.requests else 1.0

    @property
    def met(self) -> bool:
        return self.attainment >= self.target - 1e-12

    @property
    def margin(self) -> float:
        """attainment - target: negative when missed."""
        return self.attainment - self.target

    @property
    def cause(self) -> str | None:
        return self.causes.most_common(1)[0][0] if self.causes else None

    @property
    def speed(self) -> str | None:
        return SPEED.get(self.cause) if self.cause else None

    def as_dict(self) -> dict:
        return {"lane": self.lane, "requests": self.requests, "attainment": self.attainment, "target": self.target,
                "met": self.met, "cause": self.cause, "speed": self.speed, "causes": dict(self.causes),
                "missed": dict(self.missed_objectives)}


@dataclass(slots=True)
class Verdict:
    lanes: dict[str, LaneVerdict]
    backlog: dict = field(default_factory=dict)  # queue p90 of the first and last quarter of arrivals, and the limit

    @property
    def stable(self) -> bool:
        return not self.backlog or self.backlog["last_p90_s"] <= self.backlog["limit_s"]

    @property
    def met(self) -> bool:
        return self.stable and all(v.met for v in self.lanes.values())

    @property
    def binding(self) -> LaneVerdict | None:
        """The lane furthest below its target (with all met: the least margin); ties: more misses first. A run that
        does not keep up with its all lanes met binds on the lane with the longest queue in its last quarter."""
        if not self.lanes:
            return None
        if self.stable or not all(v.met for v in self.lanes.values()):
            return min(self.lanes.values(), key=lambda v: (v.margin, -sum(v.causes.values())))
        lane = self.lanes.get(self.backlog.get("lane")) or next(iter(self.lanes.values()))
        return LaneVerdict(lane.lane, lane.requests, lane.met_requests, lane.target, Counter({"backlog": 1}),
                           lane.missed_objectives)

    def as_dict(self) -> dict:
        b = self.binding
        return {"met": self.met, "stable": self.stable, "backlog": self.backlog, "binding": b.lane if b else None,
                "lanes": {k: v.as_dict() for k, v in self.lanes.items()}}


def judge(requests: list[SimRequest], goals: dict[str, LaneSLO]) -> Verdict:
    """Each lane with objectives, over its finished requests (a job's calls count in their lane), each request by
    the lane's own judge (LaneSLO.judge), as the server judges it."""
    lanes = {name: LaneVerdict(name, 0, 0, g.attainment_target) for name, g in goals.items() if g.objectives}
    for req in requests:
        verdict = lanes.get(req.lane)
        if verdict is None:
            continue
        verdict.requests += 1
        if req.error is not None or req.clock is None:
            verdict.causes["error"] += 1
            continue
        judged = goals[req.lane].judge(req.clock, req.bill or Bill(), req.num_preemptions)
        if judged.met:
            verdict.met_requests += 1
            continue
        verdict.causes[judged.cause] += 1
        verdict.missed_objectives.update(judged.missed)
    return Verdict(lanes, backlog(requests, goals))


def backlog(requests: list[SimRequest], goals: dict[str, LaneSLO]) -> dict:
    """Whether the queue grows over the run: queue-time p90 of the first and last quarter of arrivals."""
    done = sorted((r for r in requests if r.clock is not None and r.clock.queue_time is not None),
                  key=lambda r: r.arrival)
    if len(done) < 8:
        return {}
    q = len(done) // 4
    first, last = done[:q], done[-q:]
    ttfts = [o.threshold for g in goals.values() for o in g.objectives if o.metric == "ttft"]
    floor = 0.5 * min(ttfts) if ttfts else 0.5
    p90 = lambda rs: sorted(r.clock.queue_time for r in rs)[int(0.9 * (len(rs) - 1))]  # noqa: E731
    worst = max(last, key=lambda r: r.clock.queue_time)
    return {"first_p90_s": p90(first), "last_p90_s": p90(last), "limit_s": 3 * p90(first) + floor,
            "lane": worst.lane}
