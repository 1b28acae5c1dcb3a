"""Agent jobs with big tool dumps: does the diagnosis name "summarize the dump", and does summarizing show the
TTFT drop it predicts?

Run:  .venv/bin/python benchmarks/bench_agent_jobs.py [--jobs 8] [--rate 0.2] [--scale 0.5] [--summarize N]
          [--url http://HOST:PORT/v1 --model NAME --tokenizer PATH]   # default: starts `twospeed serve --model demo`

Two `twospeed bench` runs of the built-in `agent-jobs` workload on the same seed: tool dumps kept whole (the
base), then `--summarize-dumps N` with the N the base run's diagnosis asks for (or --summarize). From the
base run it takes the summarize lever's prediction (saved prefilled tokens per dump x the measured prefill
seconds per token); from the two runs it measures the TTFT of the turn after the dumps (turn 2, the `act`
step) and prints both, with the full comparison and both diagnoses. With --scale 0.5 the dumps are 2-3k tokens (the demo model holds 4096); on a server with a
longer context, --scale 1 gives the workload's 4-6k-token dumps. Timings are only meaningful on a quiet
machine; the prediction and the measurement come from the same sitting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rich.console import Console  # noqa: E402

from twospeed.lab import diagnose  # noqa: E402
from twospeed.lab.bench import BenchConfig, run_bench  # noqa: E402
from twospeed.lab.compare import print_comparison  # noqa: E402
from twospeed.lab.lane_facts import lane_facts  # noqa: E402
from twospeed.lab.local_server import LocalServer  # noqa: E402

LANE = "support-job"
DEMO_FLAGS = ["--kv-cache-memory-gb", "0.5", "--max-num-batched-tokens", "512"]


def turn_ttft(doc: dict, turn: int) -> float | None:
    turns = {t["turn"]: t for t in doc["lanes"][LANE]["jobs"]["turns"]}
    return (turns.get(turn) or {}).get("ttft_s")


def bench(args, url: str, model: str, tokenizer: str | None, label: str, summarize: int, console: Console) -> dict:
    cfg = BenchConfig(url=url, model=model, workload="agent-jobs", requests=args.jobs, rate=args.rate,
                      seed=args.seed, scale=args.scale, max_prompt_tokens=args.max_prompt_tokens,
                      max_output_tokens=args.max_output_tokens, tokenizer=tokenizer, label=label,
                      summarize_dumps=summarize, out=str(Path(args.out) / label.replace(" ", "-")), progress=False)
    console.print(f"[bold]{label}[/bold]: {args.jobs} jobs at {args.rate}/s, scale {args.scale}")
    return run_bench(cfg, console)


def run(args, url: str, model: str, tokenizer: str | None, console: Console) -> int:
    base = bench(args, url, model, tokenizer, "dumps whole", 0, console)
    prediction = diagnose.summarize_prediction(lane_facts(base, LANE))
    n = args.summarize or (prediction["target_tokens"] if prediction else 512)
    docs = [base, bench(args, url, model, tokenizer, f"summarized to {n}", n, console)]
    print_comparison(docs, console)
    for doc in docs:
        diagnose.print_diagnosis(doc, console, doc["run"]["label"])
    levers = [lv.key for d in diagnose.diagnose(base) for lv in d.levers]
    off, on = turn_ttft(docs[0], 2), turn_ttft(docs[1], 2)
    console.print(f"diagnosis of the base names summarize_dumps: {'summarize_dumps' in levers} (levers {levers})")
    if prediction and prediction["ttft_drop_s"] is not None:
        console.print(f"predicted TTFT drop on the turn after a dump (summarizing to {prediction['target_tokens']}): "
                      f"{prediction['ttft_drop_s'] * 1e3:,.0f} ms; the second run summarized to {n}")
    if off is not None and on is not None:
        console.print(f"measured turn-2 TTFT: {off * 1e3:,.0f} ms whole, {on * 1e3:,.0f} ms summarized: "
                      f"drop {(off - on) * 1e3:,.0f} ms")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.2, help="jobs/s")
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--summarize", type=int, help="--summarize-dumps of the second run (default: the diagnosis' target)")
    p.add_argument("--max-prompt-tokens", type=int, default=3900)
    p.add_argument("--max-output-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="an OpenAI-compatible server (default: start `twospeed serve --model demo`)")
    p.add_argument("--model", default="demo")
    p.add_argument("--tokenizer", help="the server's tokenizer (default: the demo model's)")
    p.add_argument("--out", default="bench_out/agent-jobs")
    args = p.parse_args()
    console = Console(width=160)
    if args.url:
        return run(args, args.url, args.model, args.tokenizer, console)
    with LocalServer("demo", DEMO_FLAGS) as server:
        return run(args, server.url, "demo", "demo", console)


if __name__ == "__main__":
    sys.exit(main())
