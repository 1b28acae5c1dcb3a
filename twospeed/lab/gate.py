"""`twospeed gate`: does a configuration (a quantization, a KV cache dtype, any serve flags) keep the baseline's
contracts and speed? Ship or no-ship per lane, with an exit code CI can use.

Both configurations are served by `twospeed serve` on this machine, one after the other, on the same model, and
replayed with the same workload (default `regression`), seed, salt and arrival times (lab/bench.py), so their
runs pair request by request; each run folder holds the lab's results.json, requests.csv and report.html, and
`twospeed compare OUT/baseline OUT/candidate` works on them. After each run the server answers the fixed
probe set (probes.py: next-token distributions at the baseline's answer positions). The verdicts
(gate_verdict.py) go to OUT/gate.json and OUT/gate.html (gate_report.py).

Exit code: 0 every lane ships, 1 some lane is no-ship, 2 the gate could not run (bad flags, a server that
did not start). `baseline_run` reuses a saved baseline run folder (its results.json and probes.json), so a
CI job can gate several candidates against one baseline.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from twospeed.lab import gate_verdict, probes, results
from twospeed.lab.bench import BenchConfig, prepare, run_bench
from twospeed.lab.fit import Fit
from twospeed.lab.compare import check_comparable
from twospeed.lab.local_server import LocalServer
from twospeed.lab.workload import load_workload

GATE_VERSION = 1
RESERVED_FLAGS = ("--model", "--port", "--host")  # the gate sets these itself


@dataclass(slots=True)
class GateConfig:
    baseline: str  # `twospeed serve` flags of the baseline, e.g. "" (the checkpoint as it is)
    candidate: str  # flags of the candidate, e.g. "--quantization int8"
    model: str = "demo"  # checkpoint folder or a built-in ("demo", "demo-task")
    workload: str = "regression"  # built-in name or YAML file (open loop)
    seed: int = 0  # fixes prompts, lengths and arrival times for both runs
    out: str = "bench_out/gate"
    requests: int = 40  # requests per run
    rate: float | None = None  # total requests/s (default: the workload's lanes' own rates)
    scale: float = 1.0  # multiplies prompt lengths
    max_prompt_tokens: int | None = None
    probes_per_lane: int = 4  # workload requests per lane whose answers are probed (3 positions each)
    top_logprobs: int = 20  # top-k of each probe's distribution (the API's limit)
    alpha: float = 0.05  # significance of "gate pass dropped beyond the noise" (one-sided, paired)
    latency_tolerance: float = 0.10  # a latency must be worse by more than this (relative), beyond the noise
    max_probe_kl: float = 1.0  # a lane's mean probe KL (nats) above this is no-ship (gate_verdict.py says why)
    baseline_run: str | None = None  # a saved baseline run folder to reuse instead of serving the baseline
    ready_timeout: float = 300.0  # seconds a server may take to start (the first demo build trains or writes)
    baseline_flags: list[str] = field(default_factory=list)
    candidate_flags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("baseline", "candidate"):
            flags = shlex.split(getattr(self, name) or "")
            bad = [f for f in flags if f.split("=")[0] in RESERVED_FLAGS]
            if bad:
                raise ValueError(f"--{name}: {', '.join(bad)} is set by the gate (use --model for both sides)")
            setattr(self, f"{name}_flags", flags)
        if (self.requests < 1 or self.probes_per_lane < 0 or not 0 < self.alpha < 1 or self.latency_tolerance < 0
                or not self.max_probe_kl > 0):
            raise ValueError("need requests >= 1, probes_per_lane >= 0, 0 < alpha < 1, latency_tolerance >= 0, "
                             "max_probe_kl > 0")
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {self.top_logprobs}")


@dataclass(slots=True)
class Side:
    """One configuration's run: its results.json document and its answers to the probe set."""

    label: str
    flags: list[str]
    doc: dict
    probe_set: list[probes.Probe]
    tops: list


def bench_config(cfg: GateConfig, url: str, label: str, tokenizer: str) -> BenchConfig:
    return BenchConfig(url=url, model=cfg.model, workload=cfg.workload, requests=cfg.requests, rate=cfg.rate,
                       seed=cfg.seed, out=str(Path(cfg.out) / label), tokenizer=tokenizer, salt=f"gate-{cfg.seed}",
                       scale=cfg.scale, max_prompt_tokens=cfg.max_prompt_tokens, label=label, progress=False)


def build_probe_set(cfg: GateConfig, bench: BenchConfig, doc: dict) -> list[probes.Probe]:
    """The baseline's probe set: the workload's plan (the same prompts the run sent) and the baseline's answers."""
    workload, planner, counter, _ = prepare(bench, fit=Fit.from_dict(doc["run"].get("fit")))
    plan = [(p, workload.lane(p.lane).endpoint) for p in planner.open_loop(cfg.requests, None) if p.job is None]
    answers = {r["index"]: r["text"] for r in doc["requests"] if r["error"] is None and r["output_tokens"] > 0}
    return probes.build(plan, answers, counter, cfg.probes_per_lane)


def warm_up(url: str, model: str) -> None:
    """One short request before the timed run, so neither side's latencies carry a fresh server's first-use costs
    (lazy initialisation, first-shape kernels): the baseline ran first and paid them alone, and once made a 4-5x
    slower candidate read as noise. A failure here is left for the timed run to report."""
    import httpx

    try:
        httpx.post(f"{url}/completions", json={"model": model, "prompt": "warm up", "max_tokens": 4}, timeout=60)
    except httpx.HTTPError:
        pass


def run_side(cfg: GateConfig, label: str, flags: list[str], tokenizer: str, probe_set: list | None, console) -> Side:
    """Serve one configuration, replay the workload, then ask it the probe set (the baseline makes the set)."""
    console.print(f"[bold]{label}[/bold]: `twospeed serve --model {cfg.model} {shlex.join(flags)}`")
    with LocalServer(cfg.model, flags, ready_timeout=cfg.ready_timeout) as server:
        warm_up(server.url, cfg.model)
        bench = bench_config(cfg, server.url, label, tokenizer)
        doc = run_bench(bench, console)
        if probe_set is None:
            probe_set = build_probe_set(cfg, bench, doc)
        tops = probes.query(server.url, cfg.model, probe_set, cfg.top_logprobs)
    (Path(cfg.out) / label / "probes.json").write_text(json.dumps(probes.to_json(probe_set, tops)))
    return Side(label, flags, doc, probe_set, tops)


def load_side(folder: str, flags: list[str]) -> Side:
    doc = results.load(folder)
    probe_set, tops = probes.from_json(json.loads((Path(folder) / "probes.json").read_text()))
    return Side(doc["run"].get("label") or "baseline", flags, doc, probe_set, tops)


def _paired(base: dict, cand: dict, lane: str) -> tuple[list[dict], list[dict]]:
    """The lane's requests both runs sent, in the same order (paired by the workload's request index)."""
    b = {r["index"]: r for r in base["requests"] if r["lane"] == lane}
    c = {r["index"]: r for r in cand["requests"] if r["lane"] == lane}
    keys = sorted(b.keys() & c.keys())
    return [b[k] for k in keys], [c[k] for k in keys]


def lane_report(lane: str, base: Side, cand: Side, counter, cfg: GateConfig, greedy: bool,
                probe: dict | None) -> dict:
    rb, rc = _paired(base.doc, cand.doc, lane)
    sb, sc = base.doc["lanes"][lane], cand.doc["lanes"][lane]
    drop = gate_verdict.mcnemar_drop([r["gate_passed"] for r in rb], [r["gate_passed"] for r in rc])
    slower = {label: gate_verdict.paired_slower([r[field] for r in rb], [r[field] for r in rc], cfg.latency_tolerance)
              for label, _, _, field in gate_verdict.LATENCY}
    judgement = gate_verdict.judge_lane(lane, sb, sc, drop, slower, cfg.alpha, cfg.latency_tolerance, probe,
                                        cfg.max_probe_kl)
    if sb["gate"]["rate"] is not None and sb["gate"]["rate"] < 0.5:
        judgement.notes.append(f"the baseline passes only {sb['gate']['rate']:.0%} of this lane's gate: it can "
                               "hardly show a regression here (a model that has learned the lane's format can)")
    answered = [(a, b) for a, b in zip(rb, rc) if a["error"] is None and b["error"] is None]
    agreement = (gate_verdict.token_agreement([(counter.ids(a["text"]), counter.ids(b["text"])) for a, b in answered])
                 if greedy and counter.exact else None)
    tokens = [r["prompt_tokens"] + r["output_tokens"] for r in rb if r["error"] is None]
    length = float(np.median(tokens)) if tokens else None
    latency = {label: {side: s["stats"][m][q] for side, s in (("baseline", sb), ("candidate", sc))}
               for label, m, q, _ in gate_verdict.LATENCY}
    return {
        "verdict": judgement.as_dict(),
        "gate": {"baseline": _rate(sb), "candidate": _rate(sc), "paired": drop},
        "latency_paired": slower,
        "latency_s": latency,
        "output_tokens_per_s": {"baseline": sb["throughput"]["output_tokens_per_s"],
                                "candidate": sc["throughput"]["output_tokens_per_s"]},
        "agreement": agreement,
        "kv_capacity": {side: gate_verdict.kv_capacity(s.doc["server"].get("memory"), length)
                        for side, s in (("baseline", base), ("candidate", cand))},
        "probes": probe,
    }


def _rate(summary: dict) -> dict:
    g = summary["gate"]
    return {"passed": g["passed"], "requests": summary["requests"], "rate": g["rate"], "rate_ci": g["rate_ci"]}


def judge(cfg: GateConfig, base: Side, cand: Side, counter) -> dict:
    """The gate document: per lane its verdict and the evidence; overall ship only if every lane ships."""
    check_comparable([base.doc, cand.doc])  # a reused baseline must be of the same workload and seed
    workload = load_workload(cfg.workload)
    probe_lanes = probes.by_lane(base.probe_set, base.tops, cand.tops)
    lanes = {}
    for lane in workload.lanes:
        if lane.name in base.doc["lanes"] and lane.name in cand.doc["lanes"]:
            lanes[lane.name] = lane_report(lane.name, base, cand, counter, cfg, lane.temperature == 0,
                                           probe_lanes.get(lane.name))
    ship = bool(lanes) and all(v["verdict"]["ship"] for v in lanes.values())
    return {"gate_version": GATE_VERSION, "model": cfg.model, "workload": cfg.workload, "seed": cfg.seed,
            "requests": cfg.requests, "alpha": cfg.alpha, "latency_tolerance": cfg.latency_tolerance,
            "baseline": {"flags": shlex.join(base.flags), "memory": base.doc["server"].get("memory")},
            "candidate": {"flags": shlex.join(cand.flags), "memory": cand.doc["server"].get("memory")},
            "probes": probes.compare(base.tops, cand.tops), "lanes": lanes, "ship": ship,
            "exit_code": 0 if ship else 1, "config": {k: v for k, v in asdict(cfg).items() if not k.endswith("_flags")}}


def model_folder(cfg: GateConfig) -> Path:
    from twospeed.builtin.registry import resolve_model_path

    return resolve_model_path(cfg.model)


def run_gate(cfg: GateConfig, console) -> dict:
    """Serve and replay both sides, judge, write gate.json and gate.html; returns the gate document."""
    from twospeed.lab.gate_report import write_html
    from twospeed.lab.prompts import TokenCounter

    tokenizer = str(model_folder(cfg))  # builds a built-in checkpoint on first use
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    if cfg.baseline_run:
        base = load_side(cfg.baseline_run, cfg.baseline_flags)
        console.print(f"[bold]baseline[/bold]: reusing the run in {cfg.baseline_run}")
    else:
        base = run_side(cfg, "baseline", cfg.baseline_flags, tokenizer, None, console)
    cand = run_side(cfg, "candidate", cfg.candidate_flags, tokenizer, base.probe_set, console)
    doc = judge(cfg, base, cand, TokenCounter(tokenizer))
    out = Path(cfg.out)
    (out / "gate.json").write_text(json.dumps(doc, indent=1, allow_nan=False))
    write_html(doc, out, cfg.baseline_run or str(out / "baseline"))
    return doc
