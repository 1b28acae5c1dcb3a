"""Paged attention on CPU: the C kernels against the portable path (gather + torch's SDPA), per shape.

Run:  .venv/bin/python benchmarks/bench_attention.py [--threads 1] [--repeats 7] [--heads 12] [--kv-heads 4]
          [--head-dim 64] [--contexts 0,256,1024,2048] [--chunks 4,8,16,64,256] [--decodes 1,8,16,32] [--quick]
          [--dtype float32]   # csrc/paged_attention.c's float32 kernels (a CPU without bf16 ones), over a
                              # float32 cache and over a bf16 one (model/kv_format.py's Bf16KV)

Which path serves a shape is a property of the CPU (model/cpu_attention.py): on AMX CPUs torch's flash
attention runs prompt chunks on AMX tiles and beats the AVX-512 BF16 kernel beyond a few rows, while decodes
(one query row per stream, G rows per KV head) stay on the kernel. This prints both paths for each shape, one
layer of the ~100M benchmark Llama's attention by default (12 heads, 4 KV heads, head_dim 64, 16-token blocks),
bf16, K and V already in the cache on scattered blocks:
  prefill  a chunk of n tokens after `context` cached ones: `CpuPagedAttention.prefill` with the kernel forced
           (flash_rows None) against `TorchPagedAttention.prefill`;
  decode   n streams, one query each, at `context` tokens: the kernel against the portable decode.
Each time is the minimum of --repeats calls (contention-robust). Nothing is written to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twospeed.model.attention import (AttentionMetadata, DecodeGroup, PrefillBatch, PrefillSpan,  # noqa: E402
                                      TorchPagedAttention)
from twospeed.model.cpu_attention import CpuPagedAttention, load_bf16_kernel  # noqa: E402
from twospeed.model.kv_format import Bf16KV  # noqa: E402

BLOCK = 16


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def scattered(num: int, pool: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(pool, generator=gen)[:num] + 1


def prefill_meta(n: int, ctx: int, table: torch.Tensor) -> AttentionMetadata:
    span = PrefillSpan(0, n, ctx, table)
    batch = PrefillBatch(table[None].clone(), torch.tensor([0]), torch.tensor([n]), torch.tensor([ctx]))
    return AttentionMetadata(torch.zeros(n, dtype=torch.int64), 0, [], [span], batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--contexts", default="0,256,1024,2048")
    ap.add_argument("--chunks", default="4,8,16,64,256")
    ap.add_argument("--decodes", default="1,8,16,32")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: csrc/paged_attention.c's float32 kernels, over a float32 and a bf16 cache")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.chunks, args.decodes, args.repeats = "0,32", "4,16", "1,4", 2
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and load_bf16_kernel() is None:
        print("the AVX-512 BF16 attention kernel does not build here: nothing to compare (--dtype float32 compares "
              "the float32 kernels)")
        return 0
    torch.set_num_threads(args.threads)
    h, kvh, d = args.heads, args.kv_heads, args.head_dim
    contexts = [int(x) for x in args.contexts.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    decodes = [int(x) for x in args.decodes.split(",")]
    blocks_per_seq = -(-(max(contexts) + max(chunks + [1])) // BLOCK)
    pool = blocks_per_seq * max(decodes) + 2
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(pool + 1, BLOCK, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(pool + 1, BLOCK, kvh, d, generator=gen).to(dtype)
    kernel, portable = CpuPagedAttention(h, kvh, d), TorchPagedAttention(h, kvh, d)
    kernel.flash_rows = None  # the kernel for every chunk: this compares the paths, not the dispatch rule

    half = dtype == torch.float32  # also the float32 kernels over the same values in a bf16 cache (Bf16KV)
    if half:
        k_half, v_half = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
        kernel_half, portable_half = CpuPagedAttention(h, kvh, d, kv=Bf16KV()), TorchPagedAttention(h, kvh, d, Bf16KV())
    print(f"{torch.get_num_threads()} thread(s), {h} heads / {kvh} KV heads / head_dim {d}, {args.dtype}, min of "
          f"{args.repeats}; AMX dispatch sends bf16 chunks over 4 tokens to the portable path\n")
    print("| prefill: context | chunk | C kernel (ms) | gather + SDPA (ms) | kernel / SDPA |"
          + (" C kernel, bf16 cache (ms) | gather + widen + SDPA, bf16 cache (ms) | kernel / SDPA |" if half else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if half else ""))
    for ctx0 in contexts:
        for n in chunks:
            ctx = ctx0 + n
            table = scattered(-(-ctx // BLOCK), pool, gen)
            q = torch.randn(n, h, d, generator=gen).to(dtype)
            out = torch.empty_like(q)
            a = best_ms(lambda: kernel.prefill(q, None, None, k_cache, v_cache, prefill_meta(n, ctx, table), out),
                        args.repeats)
            meta = prefill_meta(n, ctx, table)
            b = best_ms(lambda: portable.prefill(q, None, None, k_cache, v_cache, meta, out), args.repeats)
            extra = ""
            if half:
                c = best_ms(lambda: kernel_half.prefill(q, None, None, k_half, v_half, prefill_meta(n, ctx, table),
                                                        out), args.repeats)
                e = best_ms(lambda: portable_half.prefill(q, None, None, k_half, v_half, meta, out), args.repeats)
                extra = f" {c:.3f} | {e:.3f} | {c / e:.2f} |"
            print(f"| {ctx0} | {n} | {a:.3f} | {b:.3f} | {a / b:.2f} |{extra}", flush=True)
    print("\n| decode: streams | context | C kernel (ms) | gather + SDPA (ms) | kernel / SDPA |"
          + (" C kernel, bf16 cache (ms) | float32 / bf16 cache |" if half else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if half else ""))
    for n in decodes:
        for ctx in [c for c in contexts if c > 0]:
            nb = -(-ctx // BLOCK)
            tables = torch.stack([scattered(nb, pool, gen) for _ in range(n)])
            q = torch.randn(n, h, d, generator=gen).to(dtype)
            out = torch.empty_like(q)
            meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64), n,
                                     [DecodeGroup(0, n, tables, torch.full((n,), ctx, dtype=torch.int64))])
            a = best_ms(lambda: kernel.decode(q, k_cache, v_cache, meta, out), args.repeats)
            b = best_ms(lambda: portable.decode(q, k_cache, v_cache, meta, out), args.repeats)
            extra = ""
            if half:
                c = best_ms(lambda: kernel_half.decode(q, k_half, v_half, meta, out), args.repeats)
                extra = f" {c:.3f} | {a / c:.2f} |"
            print(f"| {n} | {ctx} | {a:.3f} | {b:.3f} | {a / b:.2f} |{extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
