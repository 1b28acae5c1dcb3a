"""The lab's subcommands (`twospeed bench`, `twospeed compare`, `twospeed diagnose`, `twospeed gate`,
`twospeed lab-demo`): flags and entry points, kept here so twospeed/cli.py only registers them."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="API root of an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model id the server expects")
    p.add_argument("--workload", required=True,
                   help="agent | rag | chat | nightly | mixed | agent-jobs | tasks | FILE.yaml | TRACE.jsonl")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="send this many requests (a job lane's arrival is a job; default 40)")
    size.add_argument("--duration", type=float, help="or send for this many seconds")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="total requests/s, open loop (default: each lane's own rate)")
    load.add_argument("--concurrency", type=int, help="closed loop: this many users, each waiting for its answer")
    p.add_argument("--seed", type=int, default=0, help="fixes every prompt, length and arrival")
    p.add_argument("--out", help="folder for results.json, requests.csv, report.html")
    p.add_argument("--tokenizer", help="tokenizer.json or checkpoint folder ('demo' for the demo model) for token counts")
    p.add_argument("--price", help="INPUT,CACHED,OUTPUT dollars per 1M tokens (default: the workload's)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--scale", type=float, default=1.0, help="multiply prompt lengths (e.g. 0.25 for a 4k-context model)")
    p.add_argument("--max-prompt-tokens", type=int, help="cap every prompt at this many tokens")
    p.add_argument("--max-output-tokens", type=int, help="cap every request's max_tokens")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="the server's context (prompt + output) where it states none; the lab reads it from "
                        "/v1/models (twospeed, vLLM) or /props (llama.cpp) and fits every prompt to it before sending")
    p.add_argument("--strict-lengths", action="store_true",
                   help="refuse a workload whose requests do not fit the server's context instead of scaling or "
                        "capping its prompts")
    p.add_argument("--salt", help="first line of every prompt (default: random, so no earlier run's cache is hit)")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM/twospeed extension)")
    p.add_argument("--summarize-dumps", type=int, metavar="TOKENS",
                   help="job lanes: tool results over TOKENS enter the history as TOKENS (0 = off; default: the workload's)")
    p.add_argument("--unstable-prefix", action="store_true",
                   help="stamp the send time into every shared prefix, as a careless harness does (defeats the cache)")
    p.add_argument("--label", help="this run's name in comparisons")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--kv-block-size", type=int, default=16, help="the server's KV block size (for KV memory)")
    p.add_argument("--metrics-period", type=float, default=2.0,
                   help="seconds between the timeline's /metrics scrapes (the server renders each on a core its "
                        "engine also wants on a small machine; faster scraping slows what it measures)")
    p.add_argument("--prompts", choices=("synthetic", "task"),
                   help="every lane's prompts: synthetic (shaped word salad) or task (the formats the built-in "
                        "demo-task model has learnt, so its gates mean something); default: each lane's own")
    p.add_argument("--endpoint", choices=("completions", "chat"),
                   help="every lane's endpoint: chat sends each prompt as a user message through the server's chat "
                        "template (an instruct model); default: each lane's own")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def bench_config(args: argparse.Namespace):
    from twospeed.lab.bench import BenchConfig

    names = {f.name for f in dataclasses.fields(BenchConfig)} - {"progress"}
    return BenchConfig(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None},
                       progress=not args.no_progress)


def run_bench_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from twospeed.lab.bench import run_bench
    from twospeed.lab.diagnose import print_diagnosis
    from twospeed.lab.report import print_summary

    console = _console()
    try:
        doc = run_bench(bench_config(args), console)
    except (ValueError, ConnectionError, OSError) as e:
        print(f"twospeed bench: {e}", file=sys.stderr)
        return 2
    print_summary(doc, console)
    print_diagnosis(doc, console)
    if args.out:
        console.print(f"wrote {args.out}/results.json, requests.csv, jobs.csv, report.html")
    return 0


def _console():
    from rich.console import Console

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=160)  # a log file or CI: don't squeeze the tables to 80 columns
    return console


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or results.json files)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def run_diagnose_command(args: argparse.Namespace) -> int:
    """Reprint the diagnosis of saved runs (recomputed from their results.json, so older runs get one too)."""
    import json

    from twospeed.lab import results
    from twospeed.lab.diagnose import diagnose, print_diagnosis

    try:
        docs = [results.load(r) for r in args.runs]
    except (ValueError, OSError) as e:
        print(f"twospeed diagnose: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({run: [d.as_dict() for d in diagnose(doc)] for run, doc in zip(args.runs, docs)}, indent=1))
        return 0
    console = _console()
    for run, doc in zip(args.runs, docs):
        print_diagnosis(doc, console, doc["run"].get("label") or run)
    return 0


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or results.json files); the first is the base")
    p.add_argument("--force", action="store_true", help="compare runs of different workloads or seeds anyway")


def run_compare_command(args: argparse.Namespace) -> int:
    from twospeed.lab.compare import load_runs, print_comparison

    try:
        docs = load_runs(args.runs, args.force)
    except (ValueError, OSError) as e:
        print(f"twospeed compare: {e}", file=sys.stderr)
        return 2
    print_comparison(docs, _console())
    return 0


def add_lab_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20, help="requests per run")
    p.add_argument("--rate", type=float, default=1.0, help="total requests/s")
    p.add_argument("--scale", type=float, default=1.0,
                   help="prompt length scale (the tasks workload is sized for demo-task's training lengths)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/lab-demo", help="folder for the two runs")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "demo-task"),
                   help="smollm2 (a real instruct model, fetched once) or demo-task (trained here, minutes once)")


def run_lab_demo_command(args: argparse.Namespace) -> int:
    from twospeed.lab.demo import run_lab_demo

    try:
        return run_lab_demo(args.requests, args.rate, args.scale, args.seed, args.out, args.model)
    except (ValueError, RuntimeError, ConnectionError, OSError) as e:
        print(f"twospeed lab-demo: {e}", file=sys.stderr)
        return 2


def add_gate_args(p: argparse.ArgumentParser) -> None:
    from twospeed.lab.gate import GateConfig

    d = GateConfig("", "")
    p.add_argument("--baseline", default="", help='`twospeed serve` flags of the baseline, quoted (default: none)')
    p.add_argument("--candidate", required=True, help='flags of the candidate, e.g. "--quantization int8"')
    p.add_argument("--model", default=d.model, help="checkpoint folder or a built-in model, served by both")
    p.add_argument("--workload", default=d.workload, help="regression (built-in) or a workload YAML")
    p.add_argument("--seed", type=int, default=d.seed, help="fixes prompts and arrival times for both runs")
    p.add_argument("--out", default=d.out, help="folder for baseline/, candidate/, gate.json, gate.html")
    p.add_argument("--requests", type=int, default=d.requests, help="requests per run")
    p.add_argument("--rate", type=float, help="total requests/s (default: the workload's lanes' own rates)")
    p.add_argument("--scale", type=float, default=d.scale, help="multiply prompt lengths")
    p.add_argument("--max-prompt-tokens", type=int, help="cap every prompt at this many tokens")
    p.add_argument("--probes-per-lane", type=int, default=d.probes_per_lane,
                   help="answered requests per lane probed for next-token distributions (3 positions each)")
    p.add_argument("--alpha", type=float, default=d.alpha, help="significance of a gate-pass drop (paired, one-sided)")
    p.add_argument("--latency-tolerance", type=float, default=d.latency_tolerance,
                   help="relative latency loss allowed beyond the noise (0.10 = 10%%)")
    p.add_argument("--max-probe-kl", type=float, default=d.max_probe_kl,
                   help="a lane whose probes' mean KL from the baseline (nats) exceeds this is no-ship")
    p.add_argument("--baseline-run", help="reuse a saved baseline run folder (OUT/baseline of an earlier gate)")


def run_gate_command(args: argparse.Namespace) -> int:
    """0: every lane ships; 1: some lane is no-ship; 2: the gate could not run."""
    from twospeed.lab.gate import GateConfig, run_gate
    from twospeed.lab.gate_report import print_gate

    names = {f.name for f in dataclasses.fields(GateConfig)} - {"baseline_flags", "candidate_flags"}
    console = _console()
    try:
        cfg = GateConfig(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
        doc = run_gate(cfg, console)
    except (ValueError, RuntimeError, ConnectionError, OSError) as e:
        print(f"twospeed gate: {e}", file=sys.stderr)
        return 2
    print_gate(doc, console)
    console.print(f"wrote {cfg.out}/gate.json, gate.html; the runs: twospeed compare {cfg.out}/baseline "
                  f"{cfg.out}/candidate", highlight=False)
    return doc["exit_code"]
