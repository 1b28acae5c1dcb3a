"""Prefix-aware routing vs round-robin on two engine replicas (Ray Serve), same replicas, same sitting.

Run:  .venv/bin/python benchmarks/bench_cluster.py [--workloads agent,agent-jobs,agent-sessions,mixed] [--requests 60]
          [--rate 2] [--rounds 2] [--replica-threads 1] [--no-direct-streams] [--engine-nice N]
          [--kv-cache-gb 0.5] [--out bench_out/cluster]
Smoke (seconds of load, not numbers): --workloads agent --requests 4 --rounds 1 --scale 0.1
On the demo model (4096 tokens) pass --scale 0.5 for agent-jobs: at 1.0 its 5k-token tool dumps do not fit, and every
job's second call is a 400 (the table's errors row says so).

It starts a local Ray (loopback), deploys two demo replicas behind a prefix-routing ingress and attaches a
round-robin ingress to the same replicas (`twospeed serve --attach-to`), then runs `twospeed bench` (the lab)
for each workload with each router, alternating which goes first round by round; every run has a fresh salt,
so no run hits another's prompts in the cache. Per workload and router it prints the cached prompt tokens
(and their share of prompt tokens), TTFT p50/p99 per lane, output tokens/s, and the router's added latency
(route_time, from every response's clock: p50/p99), then prefix / round-robin ratios. On a two-core machine the
replicas share the cores: compare the routers, not the scale-out. Targets (issue 20): cached tokens >= 1.8x
round-robin's on session-shaped agent traffic with a lower agent TTFT p50; route p99 <= 5 ms on loopback.

`agent` sends every turn the same ~2k-token prefix, so after one request per replica both routers hit it;
`agent-jobs` grows each job's history call by call (sessions), which is where affinity pays, but every job starts
with the same ~1.5k-token system block, which round-robin also finds cached on either replica (the most any
router can gain there is 1 / round-robin's cached share). `agent-sessions` is `agent-jobs` with `prefix_reuse: 0`
(each job its own system block, written here from the built-in): sessions share nothing across jobs, so what is
cached is each session's own history, and only affinity finds it. A job's number of calls depends on its answers
(gates, loops), so for the job workloads compare the cached share of prompt tokens (and per request), not the
totals. `--kv-cache-gb` sizes each replica's pool: with room for the sessions' working set once but not twice,
round-robin's copies of every session (each replica sees every session) evict each other, while affinity keeps
one copy of each; far below that both thrash, far above it round-robin finds history by parity.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from twospeed.cluster import keep_ray_on_loopback  # noqa: E402

keep_ray_on_loopback()

import numpy as np  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from twospeed.cluster.config import ClusterConfig  # noqa: E402
from twospeed.cluster.deploy import deploy, start_ray  # noqa: E402
from twospeed.config import EngineConfig  # noqa: E402
from twospeed.lab.bench import BenchConfig, run_bench  # noqa: E402
from twospeed.server.config import ServerConfig  # noqa: E402

ROUTERS = ("prefix", "round-robin")
# Workloads derived from a built-in one: name -> (built-in, lane fields set on every lane)
DERIVED = {"agent-sessions": ("agent-jobs", {"prefix_reuse": 0.0})}


def workload_spec(name: str, out: Path) -> str:
    """A built-in name or a file as it is; a DERIVED name written as a YAML file under `out`."""
    if name not in DERIVED:
        return name
    base, fields = DERIVED[name]
    doc = yaml.safe_load(resources.files("twospeed.lab").joinpath("workloads", f"{base}.yaml").read_text())
    doc["name"] = name
    for lane in doc["lanes"]:
        lane.update(fields)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def pct(values: list[float], q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def summarize(docs: list[dict]) -> dict:
    """One router's runs of one workload, pooled: cached tokens, TTFT per lane, output tok/s, route time."""
    records = [r for doc in docs for r in doc["requests"] if r["error"] is None]
    lanes = sorted({r["lane"] for r in records})
    wall = sum(doc["run"]["wall_s"] for doc in docs)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    return {"requests": len(records), "errors": sum(r["error"] is not None for doc in docs for r in doc["requests"]),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / prompt if prompt else None,
            "ttft": {lane: {"p50": pct([r["ttft_s"] for r in records if r["lane"] == lane], 50),
                            "p99": pct([r["ttft_s"] for r in records if r["lane"] == lane], 99)} for lane in lanes},
            "output_tokens_per_s": sum(r["output_tokens"] for r in records) / wall if wall else None,
            "route": {"p50": pct([r.get("server_route_s") for r in records], 50),
                      "p99": pct([r.get("server_route_s") for r in records], 99),
                      "n": sum(r.get("server_route_s") is not None for r in records)}}


def print_workload(name: str, by_router: dict[str, dict], console: Console) -> None:
    table = Table(title=f"{name}: prefix routing vs round-robin (2 replicas)")
    table.add_column("")
    for router in ROUTERS:
        table.add_column(router, justify="right")
    table.add_column("prefix / rr", justify="right")
    p, r = by_router["prefix"], by_router["round-robin"]

    def row(label, a, b, fmt, ratio=True):
        q = f"{a / b:.2f}x" if ratio and a is not None and b else "-"
        table.add_row(label, fmt(a), fmt(b), q)

    row("requests", p["requests"], r["requests"], str, ratio=False)
    row("errors", p["errors"], r["errors"], str, ratio=False)
    row("cached prompt tokens", p["cached_tokens"], r["cached_tokens"], lambda v: f"{v:,}")
    per = [x["cached_tokens"] / x["requests"] if x["requests"] else None for x in (p, r)]
    row("cached tokens per request", per[0], per[1], lambda v: "-" if v is None else f"{v:.0f}")
    row("cached share of prompt", p["cached_share"], r["cached_share"], lambda v: "-" if v is None else f"{v:.1%}")
    for lane in p["ttft"]:
        for q in ("p50", "p99"):
            row(f"TTFT {q} ms ({lane})", p["ttft"][lane][q], r["ttft"].get(lane, {}).get(q), ms)
    row("output tokens/s", p["output_tokens_per_s"], r["output_tokens_per_s"],
        lambda v: "-" if v is None else f"{v:.1f}")
    for q in ("p50", "p99"):
        row(f"route time {q} ms", p["route"][q], r["route"][q], ms)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="agent,agent-jobs,agent-sessions,mixed")
    ap.add_argument("--requests", type=int, default=60, help="requests (or jobs) per run")
    ap.add_argument("--rate", type=float, default=2.0, help="requests (or jobs) per second, open loop")
    ap.add_argument("--rounds", type=int, default=2, help="runs per router per workload (the order alternates)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies prompt lengths (the lab's --scale)")
    ap.add_argument("--max-output-tokens", type=int, default=None)
    ap.add_argument("--replica-threads", type=int, default=1)
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--direct-streams", action=argparse.BooleanOptionalAction, default=True,
                    help="requests stream over each replica's TCP channel (default), or through Ray Serve's handle")
    ap.add_argument("--engine-nice", type=int, default=15,
                    help="niceness of each replica's engine process over its actor's (ClusterConfig.engine_nice)")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5,
                    help="each replica's KV pool (GiB): below the sessions' working set twice over, round-robin's "
                         "copies of every session evict each other, and affinity keeps one copy of each")
    ap.add_argument("--out", default="bench_out/cluster")
    args = ap.parse_args(argv)
    console = Console(width=max(120, Console().width))

    start_ray(ClusterConfig(replicas=2, replica_cpus=args.replica_cpus))
    engine = EngineConfig.from_kwargs("demo", kv_cache_memory_gb=args.kv_cache_gb)
    server = ServerConfig(port=0, max_waiting=4096)
    common = dict(replicas=2, replica_cpus=args.replica_cpus, replica_threads=args.replica_threads,
                  direct_streams=args.direct_streams, engine_nice=args.engine_nice)
    urls = {"prefix": deploy(engine, server, ClusterConfig(router="prefix", app_name="twospeed", **common)),
            "round-robin": deploy(engine, server, ClusterConfig(router="round-robin", app_name="rr",
                                                                 attach_to="twospeed", **common))}
    console.print(f"replicas up: prefix at {urls['prefix']}, round-robin at {urls['round-robin']} (same replicas); "
                  f"streams {'direct' if args.direct_streams else 'through the Serve handle'}, "
                  f"engine nice {args.engine_nice}, KV pool {args.kv_cache_gb} GiB a replica")
    out = Path(args.out)
    summary = {}
    try:
        for workload in args.workloads.split(","):
            runs: dict[str, list[dict]] = {router: [] for router in ROUTERS}
            for k in range(args.rounds):
                for router in (ROUTERS if k % 2 == 0 else ROUTERS[::-1]):
                    label = f"{workload} {router} round {k}"
                    cfg = BenchConfig(url=urls[router], model="demo", workload=workload_spec(workload, out),
                                      requests=args.requests,
                                      rate=args.rate, seed=k, scale=args.scale,
                                      max_output_tokens=args.max_output_tokens, label=label, progress=False,
                                      out=str(out / workload / f"{router}-{k}"))
                    console.print(f"[bold]{label}[/bold]")
                    runs[router].append(run_bench(cfg, Console(file=open(os.devnull, "w"))))
            summary[workload] = {router: summarize(docs) for router, docs in runs.items()}
            print_workload(workload, summary[workload], console)
    finally:
        from ray import serve

        serve.shutdown()
        import ray

        ray.shutdown()
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"summary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
