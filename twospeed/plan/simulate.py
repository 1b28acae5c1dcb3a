"""One simulated run: a workload's run plan through a deployment's simulated replicas (`twospeed simulate`).

`Scenario` is what stays fixed while the planner varies the rate or the topology: the workload, the plan's
settings (seed, salt, scale, caps), the token counter (the model's tokenizer, so prompts are the ids the server
sees) and the lanes' ITL objectives as `twospeed serve --slo` hands them to the engine. `run(scenario,
deployment, rate, ...)` builds the plan exactly as `twospeed bench` does, runs the simulator, and returns the
run with its traffic; `results_doc` (plan/sim_results.py) makes results.json of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from twospeed.lab.prompts import TokenCounter
from twospeed.lab.schedule import PlanConfig, Planned, Planner
from twospeed.lab.workload import Workload
from twospeed.plan.deployment import Deployment
from twospeed.plan.sim import ModelTimer, Simulator, SimRun
from twospeed.plan.sim_workload import SimTraffic, open_loop_plan


@dataclass(slots=True)
class Scenario:
    """The traffic side of a simulation."""

    workload: Workload
    plan: PlanConfig  # seed, salt, scale, caps; its rate is set per run
    counter: TokenCounter
    requests: int | None = None  # arrivals in the plan (default 40 when no duration)
    duration: float | None = None  # or arrivals for this many seconds
    itl_targets: dict[str, float | None] = field(default_factory=dict)  # lane -> seconds (Request.itl_target)
    step_noise: float = 0.0  # lognormal sigma on every step's time (0: each step exactly its predicted time)
    _base: tuple | None = None  # (rate, plan) built once where plans differ only in their offsets
    ids: dict[int, list[int]] = field(default_factory=dict)  # token ids of plain requests' prompts, by plan index

    def plan_at(self, rate: float | None) -> tuple[Planner, list[Planned]]:
        """The run plan `twospeed bench --rate rate` would send. Arrival offsets scale as 1 / rate under a seed
        (every process draws its gaps in units of the mean), so where nothing else depends on the rate (no job
        lanes, no clock-stamped prefix, not a trace) the plan is built once and its offsets rescaled."""
        planner = Planner(self.workload, dataclasses.replace(self.plan, rate=rate), self.counter)
        reusable = (rate is not None and self.workload.trace is None and not self.plan.unstable_prefix
                    and all(lane.job is None for lane in self.workload.lanes))
        if not reusable:
            return planner, open_loop_plan(planner, self.requests, self.duration)
        if self._base is None:
            self._base = (rate, open_loop_plan(planner, self.requests, self.duration))
        base_rate, base = self._base
        k = base_rate / rate
        return planner, [dataclasses.replace(p, offset=p.offset * k) for p in base]


@dataclass(slots=True)
class Simulated:
    run: SimRun
    traffic: SimTraffic
    planner: Planner
    rate: float | None


def run(scenario: Scenario, deployment: Deployment, rate: float | None = None, **topology) -> Simulated:
    """Simulate the scenario at `rate` requests/s in total (None: the lanes' own rates) on the deployment;
    topology: replicas=N, or prefill_replicas=P, decode_replicas=D, link_bandwidth=bytes/s, link_latency_s=s."""
    planner, plan = scenario.plan_at(rate)
    cfg = deployment.sim_config(**topology)
    seeds = iter(range(10**6))
    noise, seed = scenario.step_noise, scenario.plan.seed * 1000
    sim = Simulator(cfg, deployment.cost_model, timer=lambda model: ModelTimer(model, noise, seed=seed + next(seeds)))
    traffic = SimTraffic(sim, scenario.workload, scenario.counter, scenario.itl_targets, scenario.plan.seed,
                         scenario.ids)
    traffic.add_plan(plan)
    return Simulated(sim.run(), traffic, planner, rate)
