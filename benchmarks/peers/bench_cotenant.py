"""Served batch-1 decode alone and beside one CPU-bound co-tenant process, for every engine in one sitting.

    .venv/bin/python benchmarks/peers/bench_cotenant.py                     # appends to BENCHMARKS.md
    .venv/bin/python benchmarks/peers/bench_cotenant.py --quick --out /tmp/cotenant.md

Real CPU deployments share their cores (the HTTP loop, tokenizers, sidecars, a second engine). With two
threads on two cores, a co-tenant that keeps one core busy deschedules one engine thread, and the other
waits for it at every barrier. Each engine in turn is started (serve.py), warmed up, and timed on batch-1
requests (a 512-token prompt, greedy tokens, EOS ignored; client.py's streaming client): alone, then with
one co-tenant (a Python busy loop: one runnable thread) started, then alone again (the machine may have
drifted). twospeed runs twice: with its thread governor (engine/threads.py, the default) and with
`--adapt-threads false`, the fixed two threads. Reported: decode tok/s and TTFT in each phase and the
slowdown under the co-tenant against the mean of the two alone phases.

Prerequisites as run_peers.py: setup.sh and make_checkpoint.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from client import PromptMaker, request_body, run_concurrent  # noqa: E402
from run_peers import machine, salt, warm_up  # noqa: E402
from serve import SETTINGS, model_dir, serve  # noqa: E402

BUSY_LOOP = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"
VARIANTS = {"twospeed": ("twospeed", []), "twospeed-fixed-threads": ("twospeed", ["--adapt-threads", "false"]),
            "vllm": ("vllm", []), "llama": ("llama", [])}


def phase(server, prompts: PromptMaker, repeats: int, new_tokens: int, first_index: int) -> dict:
    timings = []
    for i in range(repeats):
        body = request_body(server.model, prompts.make(512, first_index + i), new_tokens)
        timings += asyncio.run(run_concurrent(server.url, [body], 1))[0]
    return {"decode_tok_s": statistics.median(t.decode_tok_s for t in timings),
            "ttft_s": statistics.median(t.ttft_s for t in timings)}


def measure(variant: str, repeats: int, new_tokens: int) -> dict:
    engine, extra = VARIANTS[variant]
    settings = dataclasses.replace(SETTINGS, twospeed_args=extra) if engine == "twospeed" else SETTINGS
    with serve(engine, "bf16", settings) as server:
        prompts = PromptMaker(model_dir("bf16"), salt())
        warm_up(server, prompts)
        alone = phase(server, prompts, repeats, new_tokens, 0)
        tenant = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        try:
            time.sleep(1.5)  # a governor reacts within a window or two; the first request would measure that
            shared = phase(server, prompts, repeats, new_tokens, 100)
        finally:
            tenant.kill()
            tenant.wait()
        time.sleep(1.5)
        again = phase(server, prompts, repeats, new_tokens, 200)
    solo = statistics.fmean([alone["decode_tok_s"], again["decode_tok_s"]])
    return {"variant": variant, "alone": alone, "co_tenant": shared, "alone_again": again,
            "slowdown": solo / shared["decode_tok_s"] if shared["decode_tok_s"] else float("inf")}


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Co-tenancy: served batch-1 decode beside one CPU-bound process — {now}", "",
             f"- command: `.venv/bin/python benchmarks/peers/bench_cotenant.py{' --quick' if args.quick else ''}`",
             f"- {machine()}; ~100M Llama bf16 (benchmarks/peers), every engine with {SETTINGS.threads} threads; "
             f"512-token prompt, {args.new_tokens} greedy tokens, median of {args.repeats} per phase; the co-tenant "
             "is one Python busy loop", "",
             "| engine | alone tok/s | with co-tenant tok/s | alone again tok/s | slowdown | TTFT alone / co-tenant (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['alone']['decode_tok_s']:.1f} | {r['co_tenant']['decode_tok_s']:.1f} | "
                     f"{r['alone_again']['decode_tok_s']:.1f} | {r['slowdown']:.2f}x | "
                     f"{r['alone']['ttft_s'] * 1e3:.0f} / {r['co_tenant']['ttft_s'] * 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--engines", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="one request of 32 tokens per phase")
    ap.add_argument("--out", type=Path, help="write the table here instead of appending to BENCHMARKS.md")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, 32
    rows = []
    for variant in args.engines.split(","):
        print(f"[cotenant] {variant} ...", flush=True)
        rows.append(measure(variant, args.repeats, args.new_tokens))
        print(f"[cotenant] {rows[-1]}", flush=True)
    text = markdown(rows, args)
    print(text)
    target = args.out or HERE.parent.parent / "BENCHMARKS.md"
    with open(target, "a") as f:
        f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
