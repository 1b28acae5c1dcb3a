"""The AVX2 widening kernel (model/csrc/linear_widen.c) against this machine's bandwidth, at decode-sized row counts
and the prompt chunks beside decodes.

    .venv/bin/python benchmarks/bench_widen.py [--threads 2] [--reps 7]

32 distinct bf16 linears of the ~100M benchmark Llama's MLP shapes (2048 x 768 and 768 x 2048, 100 MB in all, so
each call streams its weight from memory) through `WidenPacking` at 1 to 256 activation rows: best-of-reps ms for
the 32 calls, the weight bytes a second, and GFLOP/s. The copy bandwidth (plan/hardware.measure_local: bytes read
plus written over the time of a large copy, the roofline's figure) is measured before and after, for the ratio.
Prints markdown; writes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from twospeed.model.packed_linear import WidenPacking, widen_kernel
from twospeed.plan.hardware import measure_local


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if widen_kernel() is None:
        print("linear_widen.c does not build here (it needs AVX2 and FMA)")
        return 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shapes = [(2048, 768), (768, 2048)] * 16
    weights = [WidenPacking(torch.randn(n, k, generator=g) * 0.02) for n, k in shapes]
    total = sum(w.out_features * w.in_features * 2 for w in weights)
    copy = [measure_local("cpu", seconds=2.0, dtypes=("float32",)).copy_bandwidth]
    print("| rows | 32 linears (ms) | weight GB/s | GFLOP/s |\n|---:|---:|---:|---:|")
    for rows in (1, 2, 4, 8, 16, 32, 48, 64, 128, 256):
        xs = {k: torch.randn(rows, k, generator=g) for k in (768, 2048)}
        best = float("inf")
        for _ in range(args.reps):
            start = time.perf_counter()
            for w in weights:
                w.forward(xs[w.in_features], None)
            best = min(best, time.perf_counter() - start)
        print(f"| {rows} | {best * 1e3:.2f} | {total / best / 1e9:.1f} | {total * rows / best / 1e9:.1f} |")
    copy.append(measure_local("cpu", seconds=2.0, dtypes=("float32",)).copy_bandwidth)
    print(f"\ncopy bandwidth (read + written, best of before and after): {max(copy) / 1e9:.1f} GB/s; "
          f"{args.threads} threads; weights {total / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
