"""Roofline efficiency of twospeed on this machine: prefill FLOP/s against the measured matmul peak, decode
bytes/s against the measured copy bandwidth (issue 6, measurement 5).

Run:  .venv/bin/python benchmarks/bench_roofline.py [--threads 2] [--no-write]

The ~100M benchmark Llama (bench_engine.py's shape, bf16) on the default engine (every fast path on). The
peaks come from twospeed.plan.hardware.measure_local (a 1024^3 bf16 matmul, a 64 MiB copy; best of several),
sampled before and after the engine runs; the better of the two is the ceiling. FLOPs and bytes come from
twospeed.plan.roofline (the same counts `twospeed clock --model` prints, checked against FlopCounterMode
and the checkpoint's tensors in tests/plan/test_roofline.py).
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import append_report, cpu_model, git_state, write_checkpoint  # noqa: E402
from bench_fastpath import decode_step  # noqa: E402

from twospeed import LLM, SamplingParams  # noqa: E402
from twospeed.plan import roofline as rl  # noqa: E402
from twospeed.plan.hardware import measure_local  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    probes = [measure_local("cpu", seconds=3.0, dtypes=("bfloat16",))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write_checkpoint(path, torch.bfloat16, seed=0)
        llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, max_num_batched_tokens=2048)
        cfg = llm.engine.model_config
        rng = random.Random(0)
        decode_step(llm, 2, 64, 3, rng)  # warm up
        prefill = []
        for _ in range(3):
            out = llm.generate([[rng.randrange(3, 32000) for _ in range(1024)]], SamplingParams(max_tokens=1))[0]
            prefill.append(out.clock.prefill_time)
        steps = {(1, 128): decode_step(llm, 1, 128, 32, rng), (32, 512): decode_step(llm, 32, 512, 16, rng)}
    probes.append(measure_local("cpu", seconds=3.0, dtypes=("bfloat16",)))
    peak = max(p.matmul_flops["bfloat16"] for p in probes)
    bw = max(p.copy_bandwidth for p in probes)
    t_pre = statistics.median(prefill)
    flops = rl.prefill_flops(cfg, 1024, 0, 1).total
    rows = [f"| prefill 1024 tokens, one chunk | {t_pre * 1e3:.0f} ms | {flops / 1e9:.1f} GFLOP | "
            f"{flops / t_pre / 1e9:.0f} GFLOP/s | {peak / 1e9:.0f} GFLOP/s | {flops / t_pre / peak:.0%} |"]
    for (b, c), t in steps.items():
        by = rl.decode_step_bytes(cfg, [c] * b, 2)
        rows.append(f"| decode step, batch {b}, context {c} | {t * 1e3:.1f} ms | {by.total / 1e6:.0f} MB "
                    f"(weights {by.weights / 1e6:.0f}, KV {by.kv_read / 1e6:.0f}) | {by.total / t / 1e9:.1f} GB/s | "
                    f"{bw / 1e9:.1f} GB/s | {by.total / t / bw:.0%} |")
    cmd = "python benchmarks/bench_roofline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    probe_text = "; ".join(f"{p.matmul_flops['bfloat16'] / 1e9:.0f} GFLOP/s, {p.copy_bandwidth / 1e9:.1f} GB/s"
                           for p in probes)
    text = "\n".join([
        f"## Roofline efficiency, bf16, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
        f"`{cmd.strip()}` at {git_state()}; {cpu_model()}, {args.threads} threads. Probes (before; after): "
        f"{probe_text}; the best of each is the ceiling. Decode bytes = every weight once + the K/V attended "
        f"(the copy bandwidth counts read + write bytes, as STREAM's copy does).", "",
        "| what | time | work | achieved | ceiling | efficiency |", "|---|---|---|---|---|---|", *rows, ""])
    print(text)
    if not args.no_write:
        append_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
