"""`twospeed simulate`, `twospeed plan` and `twospeed plan calibrate`: flags and entry points.

simulate   one run of a workload through simulated replicas; results.json (and the rest) as `twospeed bench`
           writes them, so `twospeed compare` sets it beside a live run
plan       the capacity answers (plan/capacity.py) under every lane's goal
calibrate  time the live engine over a sweep of shapes and write its step profile (plan/calibrate.py)

A replica is a calibrated profile (--profile) or a hardware profile and the model's config (--hardware, --model);
engine and scheduler flags are the ones `twospeed serve` takes (generated from the config dataclasses).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from twospeed.config import add_engine_args, engine_kwargs
from twospeed.schema.formats import KV_CACHE_DTYPES, QUANTIZATIONS


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """--model, the engine flags, and where step times come from."""
    add_engine_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a step profile from `twospeed plan calibrate` (this machine, measured)")
    src.add_argument("--hardware",
                     help="a hardware profile (`twospeed clock --list-hardware`) or 'local' (measured): the roofline")
    p.add_argument("--quantization", choices=("none", *QUANTIZATIONS), help="weights' format (roofline)")
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), help="KV cache format (roofline)")
    p.add_argument("--compute-efficiency", type=float, default=0.5, help="roofline: share of peak FLOP/s (0.5)")
    p.add_argument("--bandwidth-efficiency", type=float, default=0.8, help="roofline: share of peak bandwidth (0.8)")
    p.add_argument("--step-overhead-ms", type=float, default=2.0, help="roofline: host time per step (2 ms)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="roofline: share of the device's memory for weights + KV (0.9)")


def add_traffic_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--workload", required=required,
                   help="agent | rag | chat | nightly | mixed | agent-jobs | FILE.yaml | TRACE.jsonl")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="arrivals in the plan (a job lane's arrival is a job; default 40)")
    size.add_argument("--duration", type=float, help="or arrivals for this many seconds")
    p.add_argument("--seed", type=int, default=0, help="fixes every prompt, length and arrival (as bench's)")
    p.add_argument("--salt", default="", help="the prompts' first line (a live run's, to send its exact prompts)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply prompt lengths")
    p.add_argument("--max-prompt-tokens", type=int, help="cap every prompt")
    p.add_argument("--max-output-tokens", type=int, help="cap every request's max_tokens")
    p.add_argument("--summarize-dumps", type=int, metavar="TOKENS", help="job lanes: cap tool dumps (0 = off)")
    p.add_argument("--unstable-prefix", action="store_true", help="stamp the send time into every shared prefix")
    p.add_argument("--tokenizer", help="tokenizer.json or checkpoint folder (default: the model's, if it has one)")
    p.add_argument("--slo", action="append", metavar="LANE:METRIC=DURATION[,...]",
                   help="a lane's SLO as `twospeed serve --slo` takes it (repeatable)")
    p.add_argument("--step-noise", type=float, default=0.0, help="lognormal sigma on every step's time (0: none)")


def _replica(args: argparse.Namespace):
    from twospeed.config import EngineConfig
    from twospeed.plan import deployment as dp
    from twospeed.plan.step_cost import Efficiency

    if args.profile and args.model == "demo":  # --model left at its default: the model the profile was fitted on
        from twospeed.plan.profile import Profile

        args.model = Profile.load(args.profile).model or "demo"
    engine = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    if args.profile:
        return dp.from_profile(args.profile, engine)
    if not args.hardware:
        raise ValueError("give --profile (a calibrated profile) or --hardware (a roofline)")
    eff = Efficiency(args.compute_efficiency, args.bandwidth_efficiency, args.step_overhead_ms / 1e3)
    quant = None if args.quantization in (None, "none") else args.quantization
    return dp.from_hardware(args.hardware, args.model, engine, quant, args.kv_cache_dtype or "auto", eff,
                            args.gpu_memory_utilization)


def _tokenizer(args: argparse.Namespace) -> str | None:
    if args.tokenizer:
        return None if args.tokenizer == "none" else args.tokenizer
    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin

    if is_builtin(args.model):
        return str(builtin_checkpoint_path(args.model))
    from twospeed.model.checkpoint_files import find_gguf

    path = Path(args.model)
    folder = path.parent if path.is_file() else path
    if (folder / "tokenizer.json").is_file():
        return str(folder)
    return str(path) if find_gguf(path) is not None else None  # a GGUF's tokenizer is in its metadata


def _scenario(args: argparse.Namespace, itl_from_goals: dict | None = None):
    from twospeed.lab.prompts import TokenCounter
    from twospeed.lab.schedule import PlanConfig
    from twospeed.lab.workload import load_workload
    from twospeed.plan.simulate import Scenario
    from twospeed.schema.slo import parse_slo_flag

    workload = load_workload(args.workload)
    plan = PlanConfig(seed=args.seed, salt=args.salt, scale=args.scale, max_prompt_tokens=args.max_prompt_tokens,
                      max_output_tokens=args.max_output_tokens, summarize_dumps=args.summarize_dumps,
                      unstable_prefix=args.unstable_prefix)
    slos = [parse_slo_flag(s) for s in args.slo or []]
    itl = itl_from_goals if itl_from_goals is not None else {s.lane: s.itl_target for s in slos}
    return Scenario(workload, plan, TokenCounter(_tokenizer(args)), args.requests, args.duration, itl,
                    args.step_noise), slos


# -- simulate --------------------------------------------------------------------------------------
def add_simulate_args(p: argparse.ArgumentParser) -> None:
    add_replica_args(p)
    add_traffic_args(p)
    p.add_argument("--rate", type=float, help="total requests/s, open loop (default: each lane's own rate)")
    p.add_argument("--replicas", type=int, default=1, help="colocated replicas behind a least-loaded router")
    p.add_argument("--prefill-replicas", type=int, default=0, help="disaggregated: prefill pool size")
    p.add_argument("--decode-replicas", type=int, default=0, help="disaggregated: decode pool size")
    p.add_argument("--link-gbs", type=float, default=25.0, help="disaggregated: KV link bandwidth, GB/s (25)")
    p.add_argument("--link-latency-ms", type=float, default=0.5, help="disaggregated: per transfer, ms (0.5)")
    p.add_argument("--out", help="folder for results.json, requests.csv, jobs.csv, report.html")
    p.add_argument("--label", help="this run's name in comparisons")
    p.add_argument("--no-report", action="store_true", help="skip report.html")


def _topology(args: argparse.Namespace) -> dict:
    if args.prefill_replicas or args.decode_replicas:
        return {"prefill_replicas": args.prefill_replicas, "decode_replicas": args.decode_replicas,
                "link_bandwidth": args.link_gbs * 1e9, "link_latency_s": args.link_latency_ms / 1e3}
    return {"replicas": args.replicas}


def run_simulate_command(args: argparse.Namespace) -> int:
    from twospeed.lab.commands import _console
    from twospeed.lab.diagnose import print_diagnosis
    from twospeed.lab.report import print_summary
    from twospeed.plan.deployment import model_config_json
    from twospeed.plan.sim_results import SimulateConfig, results_doc, write
    from twospeed.plan.simulate import run

    try:
        replica = _replica(args)
        scenario, _ = _scenario(args)
        sim = run(scenario, replica, args.rate, **_topology(args))
    except (ValueError, OSError) as e:
        print(f"twospeed simulate: {e}", file=sys.stderr)
        return 2
    cfg = SimulateConfig(args.workload, args.model, args.requests, args.duration, args.rate, args.seed, args.salt,
                         args.scale, args.max_prompt_tokens, args.max_output_tokens, args.summarize_dumps,
                         args.unstable_prefix, args.label or "simulated", replica.block_size,
                         url=f"simulated ({replica.describe.get('cost_model')})")
    doc = results_doc(cfg, scenario.workload, scenario.counter, sim.planner, sim.traffic, sim.run,
                      model_config_json(args.model), {**replica.describe, "topology": _topology(args)})
    console = _console()
    print_summary(doc, console)
    print_diagnosis(doc, console)
    if args.out:
        write(doc, Path(args.out), report=not args.no_report)
        extra = "" if args.no_report else ", report.html"
        console.print(f"wrote {args.out}/results.json, requests.csv, jobs.csv{extra}")
    return 0


# -- plan ------------------------------------------------------------------------------------------
def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_replica_args(p)
    add_traffic_args(p, required=False)  # `plan calibrate` has no workload
    p.add_argument("--target-rate", type=float, help="requests/s the fleet must take: how many replicas")
    p.add_argument("--start-rate", type=float, help="where the rate search starts (default: the workload's own rate)")
    p.add_argument("--tolerance", type=float, default=0.05, help="the search stops within this share (0.05)")
    p.add_argument("--tune-step-ms", default="0,25,50,100", help="candidate --target-step-ms ('' to skip)")
    p.add_argument("--tune-budgets", default="512,2048,8192", help="candidate --max-num-batched-tokens ('' to skip)")
    p.add_argument("--formats", default="none/auto,int8/auto,int8/int8,fp8/fp8",
                   help="weights/KV formats to compare, roofline only ('' to skip)")
    p.add_argument("--pool-gpus", default="2", help="fleet sizes to try as prefill + decode pools ('' to skip)")
    p.add_argument("--link-gbs", type=float, default=25.0, help="pools: KV link bandwidth, GB/s (25)")
    p.add_argument("--link-latency-ms", type=float, default=0.5, help="pools: per transfer, ms (0.5)")
    p.add_argument("--no-slo-steps", action="store_true",
                   help="do not size steps by the lanes' ITL objectives (as a server without --slo)")
    p.add_argument("--quick", action="store_true", help="only the rate per replica, replicas and KV")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    sub = p.add_subparsers(dest="plan_command")
    cal = sub.add_parser("calibrate", help="time the live engine over a sweep of step shapes; write its profile")
    add_calibrate_args(cal)


def goals_for(workload, slos) -> dict:
    """Each lane's goal: the workload's SLO, replaced by a --slo flag for that lane (both one LaneSLO)."""
    goals = {lane.name: lane.slo for lane in workload.lanes}
    goals.update({s.lane: s for s in slos})
    return goals


def question(args: argparse.Namespace):
    from twospeed.plan.capacity import Question

    replica = _replica(args)
    scenario, slos = _scenario(args)
    seats = replica.scheduler.max_num_seqs
    if scenario.requests is None and scenario.duration is None:
        scenario.requests = max(200, 4 * seats)  # per replica: enough for p99 goals and for a backlog to show
    if scenario.requests is not None and scenario.requests < 4 * seats:
        raise ValueError(f"--requests {scenario.requests} is under 4 x --max-num-seqs ({seats}): a burst that fits a "
                         f"few batches shows no backlog at any rate; ask for more requests or fewer sequences")
    goals = goals_for(scenario.workload, slos)
    if not args.no_slo_steps:
        scenario.itl_targets = {lane: g.itl_target for lane, g in goals.items()}
    start = args.start_rate or sum(lane.arrival.rate for lane in scenario.workload.lanes)
    quick = args.quick
    formats = {}
    if args.hardware and args.formats and not quick:
        for spec in args.formats.split(","):
            q, _, kv = spec.partition("/")
            formats[spec] = (lambda q=q, kv=kv: _replica(argparse.Namespace(**{
                **vars(args), "quantization": q, "kv_cache_dtype": kv or "auto"})))
    ints = lambda text: tuple(int(x) for x in _floats(text))  # noqa: E731
    return Question(scenario, replica, goals, start, args.tolerance, args.target_rate,
                    () if quick else _floats(args.tune_step_ms), () if quick else ints(args.tune_budgets),
                    formats, () if quick else ints(args.pool_gpus), args.link_gbs * 1e9, args.link_latency_ms / 1e3)


def run_plan_command(args: argparse.Namespace) -> int:
    if getattr(args, "plan_command", None) == "calibrate":
        return run_calibrate_command(args)
    from twospeed.lab.commands import _console
    from twospeed.plan.capacity import answer
    from twospeed.plan.plan_report import print_plan

    if not args.workload:
        print("twospeed plan: --workload is required", file=sys.stderr)
        return 2
    try:
        report = answer(question(args))
    except (ValueError, OSError) as e:
        print(f"twospeed plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print_plan(report, _console())
    return 0


# -- calibrate -------------------------------------------------------------------------------------
def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--out", required=True, help="the profile to write (JSON)")
    p.add_argument("--chunks", default="16,64,256,1024", help="prompt chunk sizes, tokens")
    p.add_argument("--contexts", default="0,512,1536", help="cached tokens before a chunk; decode contexts")
    p.add_argument("--batches", default="1,4,16", help="streams decoding together")
    p.add_argument("--decode-steps", type=int, default=12, help="decode steps per batch and context")
    p.add_argument("--repeats", type=int, default=3, help="times each prefill shape is timed")
    p.add_argument("--no-mixed", action="store_true", help="skip the long prompt beside decoding streams")
    p.add_argument("--sweep-seed", type=int, default=0, help="the sweep's token ids")


def run_calibrate_command(args: argparse.Namespace) -> int:
    from twospeed.config import EngineConfig
    from twospeed.plan.calibrate import Sweep, calibrate

    try:
        sweep = Sweep(tuple(int(x) for x in _floats(args.chunks)), tuple(int(x) for x in _floats(args.contexts)),
                      tuple(int(x) for x in _floats(args.batches)), args.decode_steps, args.repeats, not args.no_mixed)
        engine_config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
        from twospeed.engine.engine import LLMEngine

        engine = LLMEngine(engine_config)
        profile = calibrate(engine, sweep, args.sweep_seed, say=lambda s: print(f"  {s}", flush=True))
    except (ValueError, OSError, TypeError) as e:
        print(f"twospeed plan calibrate: {e}", file=sys.stderr)
        return 2
    profile.save(args.out)
    res = profile.residuals
    print(f"wrote {args.out}: {profile.key}, {profile.sweep.get('steps')} steps timed; relative error p50 / p90 / max: "
          + "; ".join(f"{k} {v['p50']:.3f} / {v['p90']:.3f} / {v['max']:.3f} (n={v['n']})"
                      for k, v in res.items() if v["n"]))
    coef = ", ".join(f"{name} {c:.3g}" for name, c in zip(profile.as_dict()["features"], profile.coefficients))
    print(f"coefficients (s, s/token, s/pair, s/token, s/context token, s/row): {coef}")
    return 0
