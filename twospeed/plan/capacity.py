"""Capacity questions, answered by search in the simulator (`twospeed plan`).

  max rate      the highest total request rate one replica sustains with every lane meeting its goal
                (plan/verdict.py): doubling (or halving) from a start to bracket the boundary, then bisection
                in log space until the rate that fails is within `tolerance` of the one that meets; both are
                reported, with the lane that binds at the failing one and the speed it lacked.
  replicas      for a target rate: ceil(target / max rate), checked by simulating that many replicas behind
                the least-loaded router at the target (one more until it meets).
  tuning        max rate over candidate step-time targets (target_step_ms) at the configured token budget,
                then over candidate budgets (max_num_batched_tokens) at the best target.
  formats       max rate and KV capacity for each weight / KV format (a deployment per format).
  pools         P prefill + D decode replicas (DistServe) against the same number colocated, at each split.

Each simulated point uses the same seed, so every rate sends the same requests with the same lengths; only the
offsets scale (common random numbers: the search compares like with like). The requests per replica stay fixed
when the replica count grows, so each replica sees the same traffic length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from twospeed.plan.deployment import Deployment
from twospeed.plan.simulate import Scenario, Simulated, run
from twospeed.plan.verdict import Verdict, judge
from twospeed.schema.slo import LaneSLO


@dataclass(slots=True)
class Point:
    """One simulated rate and what came of it."""

    rate: float
    verdict: Verdict
    lanes: dict  # per lane TTFT and ITL p50/p99 (s), from the simulated requests
    peak_kv_blocks: int  # the most blocks in use at once on any replica
    cached_blocks: int  # blocks holding a cached prefix at the end (all replicas)

    def as_dict(self) -> dict:
        b = self.verdict.binding
        return {"rate": self.rate, "met": self.verdict.met, "binding": b.as_dict() if b else None,
                "verdict": self.verdict.as_dict(), "lanes": self.lanes, "peak_kv_blocks": self.peak_kv_blocks,
                "cached_blocks": self.cached_blocks}


@dataclass(slots=True)
class RateSearch:
    best: Point | None  # the highest rate found that meets every goal (None: not even the lowest tried)
    above: Point | None  # the lowest rate found above it that does not (None: never failed within the limit)
    tried: list[tuple[float, bool]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"max_rate": self.best.rate if self.best else 0.0, "best": self.best.as_dict() if self.best else None,
                "above": self.above.as_dict() if self.above else None, "tried": self.tried}


def point(sim: Simulated, goals: dict[str, LaneSLO]) -> Point:
    reqs = sim.traffic.requests
    lanes = {}
    for name in dict.fromkeys(r.lane for r in reqs):
        done = [r for r in reqs if r.lane == name and r.clock is not None and r.clock.first_token is not None]
        ttft = [r.clock.ttft for r in done]
        itl = [g for r in done for g in r.clock.itl]
        lanes[name] = {"requests": len(done), "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
                       "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99)}
    return Point(sim.rate, judge(reqs, goals), lanes, max(sim.run.peak_kv_blocks, default=0),
                 sum(sim.run.cached_blocks))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def max_rate(evaluate: Callable[[float], Point], start: float, tolerance: float = 0.05, limit: int = 24) -> RateSearch:
    """Bracket, then bisect (log space) the boundary between a rate that meets and one that does not."""
    if not start > 0 or not tolerance > 0:
        raise ValueError("the start rate and the tolerance must be > 0")
    points: dict[float, Point] = {}

    def at(r: float) -> Point:
        if r not in points:
            points[r] = evaluate(r)
        return points[r]

    lo = hi = None
    p = at(start)
    if p.verdict.met:
        lo = p
        while hi is None and len(points) < limit:
            p = at(lo.rate * 2)
            lo, hi = (p, None) if p.verdict.met else (lo, p)
    else:
        hi = p
        while lo is None and len(points) < limit and hi.rate > start / 2**12:
            p = at(hi.rate / 2)
            lo, hi = (p, hi) if p.verdict.met else (None, p)
    while lo is not None and hi is not None and hi.rate > lo.rate * (1 + tolerance) and len(points) < limit:
        p = at(math.sqrt(lo.rate * hi.rate))
        lo, hi = (p, hi) if p.verdict.met else (lo, p)
    return RateSearch(lo, hi, [(r, points[r].verdict.met) for r in sorted(points)])


@dataclass(slots=True)
class Question:
    """What `twospeed plan` is asked."""

    scenario: Scenario
    deployment: Deployment
    goals: dict[str, LaneSLO]
    start_rate: float  # where the search starts (the workload's own total rate)
    tolerance: float = 0.05
    target_rate: float | None = None  # requests/s the fleet must take (replicas answer)
    step_targets_ms: tuple[float, ...] = ()  # candidate target_step_ms (0: steps by tokens only)
    budgets: tuple[int, ...] = ()  # candidate max_num_batched_tokens
    formats: dict[str, Callable[[], Deployment]] = field(default_factory=dict)  # name -> a deployment in that format
    pool_gpus: tuple[int, ...] = ()  # fleet sizes to split into prefill + decode pools
    link_bandwidth: float = 25e9  # bytes/s between the pools
    link_latency_s: float = 0.0005
    _scaled: dict[int, Scenario] = field(default_factory=dict)  # the scenario with requests x N, per N replicas

    def scenario_for(self, replicas: int) -> Scenario:
        """The scenario with as many requests per replica as one replica gets (built once per size)."""
        if replicas == 1:
            return self.scenario
        if replicas not in self._scaled:
            requests = (self.scenario.requests or 40) * replicas
            self._scaled[replicas] = dataclasses.replace(self.scenario, requests=requests, _base=None, ids={})
        return self._scaled[replicas]


def search(q: Question, deployment: Deployment, start: float | None = None, **topology) -> RateSearch:
    """max_rate of `deployment` under the question's goals; topology as plan/simulate.run takes it."""
    n = topology.get("replicas", 1) if "prefill_replicas" not in topology else (
        topology["prefill_replicas"] + topology["decode_replicas"])
    scenario = q.scenario_for(n)
    return max_rate(lambda r: point(run(scenario, deployment, r, **topology), q.goals), start or q.start_rate * n,
                    q.tolerance)


def replicas_for(q: Question, per_replica: RateSearch) -> dict | None:
    """Replicas for the target rate: the estimate from one replica's max rate, checked by simulating them."""
    if q.target_rate is None or per_replica.best is None:
        return None
    n = max(1, math.ceil(q.target_rate / per_replica.best.rate))
    checks = []
    for extra in range(4):
        k = n + extra
        p = point(run(q.scenario_for(k), q.deployment, q.target_rate, replicas=k), q.goals)
        checks.append({"replicas": k, "met": p.verdict.met, "point": p.as_dict()})
        if p.verdict.met:
            return {"target_rate": q.target_rate, "estimate": n, "replicas": k, "checks": checks}
    return {"target_rate": q.target_rate, "estimate": n, "replicas": None, "checks": checks}


def tune(q: Question, base: RateSearch) -> dict | None:
    """The step-time target (at the configured budget), then the token budget (at the best target), that let one
    replica take the most."""
    if not q.step_targets_ms and not q.budgets:
        return None
    sched = q.deployment.scheduler
    default = (sched.target_step_ms or 0.0, sched.max_num_batched_tokens)
    found = {default: base}

    def rate(key: tuple[float, int]) -> float:
        s = found[key]
        return s.best.rate if s.best else 0.0

    def consider(target: float, budget: int) -> None:
        if (target, budget) not in found:
            dep = q.deployment.with_scheduler(target_step_ms=target or None, max_num_batched_tokens=budget)
            found[target, budget] = search(q, dep, rate(best) or None)

    best = default
    for target in q.step_targets_ms:
        consider(float(target), default[1])
        best = max(found, key=rate)
    for budget in q.budgets:
        consider(best[0], int(budget))
        best = max(found, key=rate)
    return {"rows": [_row(t, b, s) for (t, b), s in found.items()],
            "best": {"target_step_ms": best[0], "max_num_batched_tokens": best[1], "max_rate": rate(best)}}


def _row(target_ms: float, budget: int, s: RateSearch) -> dict:
    b = s.above.verdict.binding if s.above else None
    return {"target_step_ms": target_ms, "max_num_batched_tokens": budget, "max_rate": s.best.rate if s.best else 0.0,
            "binding": b.lane if b else None, "cause": b.cause if b else None}


def formats(q: Question) -> list[dict]:
    rows = []
    for name, make in q.formats.items():
        dep = make()
        s = search(q, dep)
        b = s.above.verdict.binding if s.above else None
        rows.append({"format": name, "max_rate": s.best.rate if s.best else 0.0,
                     "kv_capacity_tokens": dep.kv_capacity_tokens, "weight_bytes": dep.weight_bytes,
                     "binding": b.lane if b else None, "cause": b.cause if b else None,
                     "speed": b.speed if b else None})
    return rows


def pools(q: Question, per_replica: RateSearch) -> list[dict]:
    """For each fleet size G: G colocated replicas against every split into P prefill + D decode replicas."""
    out = []
    start = per_replica.best.rate if per_replica.best else q.start_rate
    for gpus in q.pool_gpus:
        if gpus < 2:
            continue
        colocated = search(q, q.deployment, start * gpus, replicas=gpus)
        rows = [{"prefill": None, "decode": None, **_pool_row(colocated, gpus)}]
        for p in range(1, gpus):
            s = search(q, q.deployment, start * gpus, prefill_replicas=p, decode_replicas=gpus - p,
                       link_bandwidth=q.link_bandwidth, link_latency_s=q.link_latency_s)
            rows.append({"prefill": p, "decode": gpus - p, **_pool_row(s, gpus)})
        best = max(rows, key=lambda r: r["max_rate"])
        out.append({"gpus": gpus, "rows": rows, "best": best, "disaggregated_wins": best["prefill"] is not None})
    return out


def _pool_row(s: RateSearch, gpus: int) -> dict:
    b = s.above.verdict.binding if s.above else None
    rate = s.best.rate if s.best else 0.0
    return {"max_rate": rate, "per_gpu": rate / gpus, "binding": b.lane if b else None,
            "cause": b.cause if b else None, "speed": b.speed if b else None}


def kv_report(q: Question, best: Point | None) -> dict:
    """The pool, what each lane's pinned (shared) prefix holds in it, and what the run at the max rate used."""
    dep = q.deployment
    per_token = dep.kv_bytes_per_token
    lanes = {}
    for lane in q.scenario.workload.lanes:
        tokens = round(lane.prefix_tokens * q.scenario.plan.scale)
        blocks = tokens // dep.block_size
        lanes[lane.name] = {"prefix_tokens": tokens, "cached_blocks": blocks,
                            "bytes": blocks * dep.block_size * per_token,
                            "share_of_pool": blocks / dep.num_blocks if dep.num_blocks else None,
                            "reuse": lane.prefix_reuse}
    return {"pool": dep.describe.get("memory"), "prefixes": lanes,
            "at_max_rate": None if best is None else {"peak_kv_blocks": best.peak_kv_blocks,
                                                      "peak_share": best.peak_kv_blocks / dep.num_blocks,
                                                      "cached_blocks_at_end": best.cached_blocks}}


def answer(q: Question) -> dict:
    """Every question at once, as a JSON-ready report (plan/plan_report.py prints it)."""
    per_replica = search(q, q.deployment)
    goals = {k: [o.name + f"<={o.threshold * 1e3:g}ms" for o in g.objectives] for k, g in q.goals.items()}
    return {"deployment": q.deployment.describe, "goals": goals,
            "per_replica": per_replica.as_dict(), "replicas": replicas_for(q, per_replica),
            "tuning": tune(q, per_replica), "kv": kv_report(q, per_replica.best), "formats": formats(q),
            "pools": pools(q, per_replica)}
