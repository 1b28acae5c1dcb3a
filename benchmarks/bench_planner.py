"""The planner against the live engine on this CPU: simulated against measured, lane by lane, and the max rate.

Run on a quiet machine (roughly 30 minutes at the defaults):
    .venv/bin/python benchmarks/bench_planner.py [--model PATH] [--workloads chat,agent,mixed]
        [--fractions 0.5,0.85,1.0,1.15] [--requests 128] [--out BENCHMARKS.md | --no-write] [--keep DIR]
    .venv/bin/python benchmarks/bench_planner.py --smoke     # minutes: the demo model, tiny sizes, nothing written

The model is the peers' ~100M Llama in bf16 (benchmarks/peers/make_checkpoint.py writes it under
benchmarks/peers/.work/models/llama100m-bf16) unless --model names another folder; the engine runs with
benchmarks/peers/serve.py's settings (2 threads, 32 sequences, 4096 tokens, 2 GiB of KV) and its defaults.

1. `twospeed plan calibrate` times the engine over a sweep of step shapes and writes profile.json (residuals
   reported by kind of step).
2. Per workload, `twospeed plan --profile profile.json --quick --no-slo-steps` predicts R*, the highest rate at
   which every lane meets the workload's own SLO and the queue does not grow (the server runs without --slo, so
   its steps are sized by the default target only).
3. The ladder: at each fraction x R*, the same requests (seed, a fresh salt per run, --ignore-eos, --scale 0.3) go
   to a live `twospeed serve` (`twospeed bench`) and to `twospeed simulate --profile profile.json`; per lane the
   report gives TTFT p50/p99, ITL p50/p99, output tok/s and cache-hit tokens, live and simulated, and the error
   (simulated / live - 1).
4. The max rate: the highest rung whose live run meets every lane's SLO without a growing queue (the planner's own
   rule, plan/verdict.py, applied to the live results), against R*.

The issue's targets, checked at the end: below saturation (rungs under R*) TTFT and ITL p50 and p99 within 10% of
live and output tok/s within 5%; R* within 15% of the live max (the 0.85 / 1.0 / 1.15 rungs bracket it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(ROOT))

from bench_itl_promise import twospeed_server  # noqa: E402
from serve import SETTINGS  # noqa: E402

DEFAULT_MODEL = HERE / "peers" / ".work" / "models" / "llama100m-bf16"
SMOKE_WORKLOAD = """name: smoke-chat
lanes:
  - {name: chat, kind: chat, arrival: {process: poisson, rate: 1}, prompt_tokens: {dist: uniform, min: 56, max: 200},
     max_tokens: 32, slo: {ttft_p99_ms: 120000, itl_p99_ms: 30000}}
"""
METRICS = (("TTFT p50", "ttft", "p50"), ("TTFT p99", "ttft", "p99"), ("ITL p50", "itl", "p50"),
           ("ITL p99", "itl", "p99"))
ENGINE_FLAGS = ["--max-num-seqs", str(SETTINGS.max_num_seqs), "--max-model-len", str(SETTINGS.max_model_len),
                "--kv-cache-memory-gb", str(SETTINGS.kv_cache_gib)]  # serve.py's, as the live server gets them


def cli(args: list[str], log: Path, threads: int) -> subprocess.CompletedProcess:
    """`twospeed ARGS` in a fresh process (its output in `log`)."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    with open(log, "a") as f:
        f.write("$ twospeed " + " ".join(args) + "\n")
        f.flush()
        return subprocess.run([sys.executable, "-m", "twospeed.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                              cwd=ROOT, env=env)


def traffic_flags(cfg: SimpleNamespace, workload: str, rate: float | None, salt: str | None) -> list[str]:
    flags = ["--workload", workload, "--requests", str(cfg.requests), "--seed", str(cfg.seed),
             "--scale", str(cfg.scale), "--max-prompt-tokens", str(cfg.max_prompt_tokens)]
    flags += ["--rate", f"{rate:.6g}"] if rate else []
    flags += ["--salt", salt] if salt else []
    return flags + (["--max-output-tokens", str(cfg.max_output_tokens)] if cfg.max_output_tokens else [])


def predicted_rate(cfg: SimpleNamespace, workload: str, profile: Path, scratch: Path) -> dict:
    out = scratch / f"plan-{Path(workload).stem}.json"
    args = ["plan", "--profile", str(profile), "--model", str(cfg.model), *cfg.engine, "--quick", "--no-slo-steps",
            "--json", *traffic_flags(cfg, workload, None, None), "--tolerance", "0.03"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "twospeed.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"twospeed plan failed: {done.stderr[-800:]}")
    out.write_text(done.stdout)
    return json.loads(done.stdout)["per_replica"]


def lane_view(doc: dict) -> dict:
    """Per lane: the four latencies (s), output tok/s, cache-hit tokens, SLO verdict; and the run's backlog."""
    lanes = {}
    for name, lane in doc["lanes"].items():
        st = lane["stats"]
        lanes[name] = {**{label: st[m][q] for label, m, q in METRICS},
                       "output tok/s": lane["throughput"]["output_tokens_per_s"],
                       "cache hit tokens": lane["bill"]["cached_tokens"], "slo_met": lane["slo"]["met"],
                       "errors": lane["errors"]}
    return {"lanes": lanes, "output tok/s": doc["total"]["throughput"]["output_tokens_per_s"],
            "met": verdict(doc)}


def verdict(doc: dict) -> bool:
    """The planner's rule on a results.json: every lane with an SLO met, and the queue not growing (the last
    quarter's server queue p90 within 3x the first quarter's plus half the tightest TTFT objective)."""
    if any(lane["slo"]["met"] is False for lane in doc["lanes"].values()):
        return False
    reqs = sorted((r for r in doc["requests"] if r["server_queue_s"] is not None), key=lambda r: r["sent_s"])
    if len(reqs) < 8:
        return True
    q = len(reqs) // 4
    p90 = lambda rs: sorted(r["server_queue_s"] for r in rs)[int(0.9 * (len(rs) - 1))]  # noqa: E731
    ttfts = [lane["slo"].get("ttft_p99_ms") for lane in doc["lanes"].values() if lane["slo"].get("ttft_p99_ms")]
    floor = 0.5 * min(ttfts) / 1e3 if ttfts else 0.5
    return p90(reqs[-q:]) <= 3 * p90(reqs[:q]) + floor


def measure(cfg: SimpleNamespace, scratch: Path) -> dict:
    log = scratch / "bench_planner.log"
    profile = scratch / "profile.json"
    cal = ["plan", "calibrate", "--model", str(cfg.model), *cfg.engine, "--out", str(profile), *cfg.sweep]
    if cli(cal, log, cfg.threads).returncode != 0:
        raise RuntimeError(f"calibrate failed; see {log}")
    report = {"profile": json.loads(profile.read_text()), "workloads": {}}
    with twospeed_server(SimpleNamespace(model=cfg.model, threads=cfg.threads), "time-50", scratch / "serve.log",
                         tuple(cfg.engine)) as server:
        for workload in cfg.workloads:
            plan = predicted_rate(cfg, workload, profile, scratch)
            rstar = plan["max_rate"]
            rungs = {}
            if not rstar > 0:
                print(f"{workload}: no rate meets every lane's SLO in the simulator; no ladder", flush=True)
            for f in cfg.fractions if rstar > 0 else []:
                rate = rstar * f
                salt = secrets.token_hex(6)
                tag = f"{Path(workload).stem}-{f}"
                live_dir, sim_dir = scratch / f"{tag}-live", scratch / f"{tag}-sim"
                bench = ["bench", "--url", server.url + "/v1", "--model", server.model, "--tokenizer", str(cfg.model),
                         *traffic_flags(cfg, workload, rate, salt), "--ignore-eos", "--no-progress",
                         "--timeout", str(cfg.timeout), "--out", str(live_dir)]
                sim = ["simulate", "--profile", str(profile), "--model", str(cfg.model), *cfg.engine,
                       *traffic_flags(cfg, workload, rate, salt), "--no-report", "--out", str(sim_dir)]
                ok_live = cli(bench, log, 1).returncode == 0 and (live_dir / "results.json").is_file()
                ok_sim = cli(sim, log, 1).returncode == 0 and (sim_dir / "results.json").is_file()
                rungs[f] = {"rate": rate,
                            "live": lane_view(json.loads((live_dir / "results.json").read_text())) if ok_live else None,
                            "sim": lane_view(json.loads((sim_dir / "results.json").read_text())) if ok_sim else None}
                print(f"{tag} @ {rate:.3g}/s ({f} x R*): live {'ok' if ok_live else 'FAILED'}, sim "
                      f"{'ok' if ok_sim else 'FAILED'}", flush=True)
            report["workloads"][workload] = {"plan": plan, "rungs": rungs}
    return report


# -- the report ------------------------------------------------------------------------------------------
def _err(sim: float | None, live: float | None) -> float | None:
    return None if sim is None or not live else sim / live - 1


def _fmt(v: float | None, scale: float = 1e3, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def report_text(cfg: SimpleNamespace, data: dict) -> str:
    prof = data["profile"]
    res = prof["residuals"]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    from bench_engine import cpu_model, git_state

    lines = [f"## {stamp} — bench_planner: the simulator against the live engine (at {git_state()})", "",
             f"`benchmarks/bench_planner.py` on {cpu_model()}; model {Path(cfg.model).name}, {cfg.threads} threads, "
             f"serve.py's settings; {cfg.requests} requests a run, seed {cfg.seed}, scale {cfg.scale}, --ignore-eos.",
             "", "Calibration (`twospeed plan calibrate`): " + ", ".join(
                 f"{k} |error| p50 {v['p50']:.3f}, p90 {v['p90']:.3f}, max {v['max']:.3f} (n={v['n']})"
                 for k, v in res.items() if v.get("n")), ""]
    worst_below: dict[str, float] = {}
    checks = []
    for workload, w in data["workloads"].items():
        rstar = w["plan"]["max_rate"]
        name = Path(workload).stem
        lines += [f"### {name}: R* = {rstar:.3g} req/s predicted" + ("" if rstar > 0 else
                  " (no rate meets every lane's SLO in the simulator: no ladder run)"), "",
                  "| rung | lane | " + " | ".join(label for label, _, _ in METRICS) +
                  " | out tok/s | cache hit tok | SLO live/sim |", "|---|---|" + "---:|" * (len(METRICS) + 2) + "---|"]
        live_max = 0.0
        for f, rung in sorted(w["rungs"].items(), key=lambda kv: float(kv[0])):
            live, sim = rung["live"], rung["sim"]
            if live is None or sim is None:
                lines.append(f"| {float(f):g} x ({rung['rate']:.3g}/s) | run failed | |")
                continue
            if live["met"]:
                live_max = max(live_max, rung["rate"])
            for lane, lv in live["lanes"].items():
                sv = sim["lanes"].get(lane, {})
                cells = []
                for label, _, _ in METRICS:
                    e = _err(sv.get(label), lv.get(label))
                    cells.append(f"{_fmt(lv.get(label))} / {_fmt(sv.get(label))} ({_fmt(e, 100)}%)")
                    if float(f) < 1 and e is not None:
                        worst_below[label] = max(worst_below.get(label, 0.0), abs(e))
                e = _err(sv.get("output tok/s"), lv.get("output tok/s"))
                if float(f) < 1 and e is not None:
                    worst_below["output tok/s"] = max(worst_below.get("output tok/s", 0.0), abs(e))
                cells.append(f"{_fmt(lv['output tok/s'], 1, 1)} / {_fmt(sv.get('output tok/s'), 1, 1)} "
                             f"({_fmt(e, 100)}%)")
                cells.append(f"{lv['cache hit tokens']:,} / {sv.get('cache hit tokens', 0):,}")
                cells.append(f"{lv['slo_met']} / {sv.get('slo_met')}")
                lines.append(f"| {float(f):g} x ({rung['rate']:.3g}/s) | {lane} | " + " | ".join(cells) + " |")
            lines.append(f"| | run | verdict live {'met' if live['met'] else 'missed'}, simulated "
                         f"{'met' if sim['met'] else 'missed'} | | | | | | |")
        lines.append("")
        off = None if not live_max else rstar / live_max - 1
        checks.append((name, rstar, live_max, off))
        lines += [f"live max on the ladder: {live_max:.3g} req/s" + (f"; R* is {off:+.0%} off" if off is not None else
                                                                     " (no rung met)"), ""]
    lines += ["### Targets", "", "Each cell above: live / simulated (error). Below saturation (rungs under R*):"]
    for label, limit in [(m[0], 0.10) for m in METRICS] + [("output tok/s", 0.05)]:
        if label in worst_below:
            v = worst_below[label]
            verdict_ = "met" if v <= limit else "MISSED"
            lines.append(f"- {label}: worst |error| {v:.0%} against {limit:.0%} — {verdict_}")
    for workload, rstar, live_max, off in checks:
        lines.append(f"- {workload}: R* {rstar:.3g} req/s against the live ladder's max {live_max:.3g} — "
                     + ("no rung met live" if off is None else
                        f"{off:+.0%}, {'met' if abs(off) <= 0.15 else 'MISSED'} (target within 15%; the rungs are "
                        f"{', '.join(str(f) for f in cfg.fractions)} x R*, so the ladder resolves it to those steps)"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="bf16 checkpoint folder (HF layout)")
    ap.add_argument("--workloads", default="chat,agent,mixed")
    ap.add_argument("--fractions", default="0.5,0.85,1.0,1.15", help="rungs as fractions of the predicted max rate")
    ap.add_argument("--requests", type=int, default=128, help="requests per run (>= 4 x max_num_seqs)")
    ap.add_argument("--scale", type=float, default=0.3)
    ap.add_argument("--max-prompt-tokens", type=int, default=3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=SETTINGS.threads)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help="append the report here")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
    ap.add_argument("--keep", type=Path, help="keep every run's results, logs and the profile here")
    ap.add_argument("--smoke", action="store_true", help="the demo model, one workload, tiny sizes; writes nothing")
    args = ap.parse_args(argv)
    cfg = SimpleNamespace(model=args.model, workloads=args.workloads.split(","),
                          fractions=[float(x) for x in args.fractions.split(",")], requests=args.requests,
                          scale=args.scale, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                          threads=args.threads, timeout=args.timeout, sweep=[], engine=list(ENGINE_FLAGS),
                          max_output_tokens=None)
    if args.smoke:
        from twospeed.builtin.demo import demo_checkpoint_path

        cfg.model, cfg.fractions, cfg.scale = demo_checkpoint_path(), [0.5, 1.0], 1.0
        cfg.requests, cfg.max_prompt_tokens, cfg.timeout, cfg.max_output_tokens = 16, 1500, 120.0, 48
        cfg.engine += ["--max-num-seqs", "4"]  # later flags win: 16 requests are 4 x the seats
        cfg.sweep = ["--chunks", "16,64", "--contexts", "0,64", "--batches", "1,4", "--decode-steps", "3",
                     "--repeats", "1", "--no-mixed"]
        args.no_write = True
    if not Path(cfg.model).is_dir():
        ap.error(f"{cfg.model}: no checkpoint (benchmarks/peers/make_checkpoint.py writes it, or pass --model)")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        if args.smoke:  # objectives a loaded machine meets, so the whole ladder runs
            (scratch / "smoke-chat.yaml").write_text(SMOKE_WORKLOAD)
            cfg.workloads = [str(scratch / "smoke-chat.yaml")]
        data = measure(cfg, scratch)
        (scratch / "bench_planner.json").write_text(json.dumps(data, indent=1, default=str))
    text = report_text(cfg, data)
    print("\n" + text)
    if not args.no_write:
        from bench_engine import append_report

        append_report(args.out, text)
        print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
