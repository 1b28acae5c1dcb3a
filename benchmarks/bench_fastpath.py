"""The engine's CPU fast paths against the portable ones, in the same process, on the ~100M benchmark Llama.

Run:  .venv/bin/python benchmarks/bench_fastpath.py [--dtype bfloat16|float32] [--threads 2] [--quick]
          [--out BENCHMARKS.md | --no-write]

Variants, each adding one fast path to the one before (EngineConfig fields, then kernels switched off on the
built model): `portable` (torch ops only), `onednn` (oneDNN-reordered bf16 weights and the portable C decode
kernel, csrc/paged_attention.c: the default engine before the C linear kernel), `+linear` (csrc/linear_bf16.c),
`+attention` (csrc/attention_bf16.c: bf16 decode and prefill attention), `fast` (+ the fused residual/RMSNorm,
SiLU-and-multiply and RoPE/cache-write kernels: the default engine). Each variant's engine is built once; then, round-robin over the variants so that drift of this VM
hits them alike, each measures:
  decode step at batch B and context C (median step time of pure-decode steps: B requests with C-token prompts,
  prefilled first, then stepped), and a 1024-token prefill (one unchunked 1024-token prompt, median over rounds).
Greedy tokens of every variant are checked identical to `portable`'s on the bf16 runs' first request (the oneDNN
packing is bit-identical; the kernels differ in the float summation order only).
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

from twospeed import LLM, SamplingParams  # noqa: E402

VARIANTS = {  # name: (EngineConfig fields, bf16 attention kernels on, fused small-op kernels on)
    "portable": (dict(linear_backend="torch", attention_backend="torch"), False, False),
    "onednn": (dict(linear_backend="onednn", attention_backend="auto"), False, False),
    "+linear": (dict(linear_backend="auto", attention_backend="auto"), False, False),
    "+attention": (dict(linear_backend="auto", attention_backend="auto"), True, False),
    "fast": (dict(linear_backend="auto", attention_backend="auto"), True, True),
}


def switch_kernels(llm: LLM, bf16_attention: bool, fused: bool) -> None:
    """Turn the built model's optional CPU kernels off (they are on by default where they build)."""
    from twospeed.model.cpu_attention import CpuPagedAttention
    from twospeed.model.llama import MLP, Attention, RMSNorm
    for m in llm.engine.model.modules():
        if isinstance(m, (RMSNorm, MLP)):
            m.use_kernel = fused
        if isinstance(m, Attention):
            m.fused_rope = m.fused_rope and fused
            if isinstance(m.attn, CpuPagedAttention) and not bf16_attention:
                m.attn.bf16_kernel = m.attn.prefill_kernel = None


def decode_step(llm: LLM, batch: int, ctx: int, steps: int, rng: random.Random) -> float:
    eng = llm.engine
    for _ in range(batch):
        eng.add_request(None, [rng.randrange(3, 32000) for _ in range(ctx)],
                        SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        if eng.last_stats.num_prefill_tokens == 0:
            break
    times = []
    for _ in range(steps):
        eng.step()
        times.append(eng.last_stats.step_time)
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    return statistics.median(times)


def prefill(llm: LLM, n: int, rng: random.Random) -> float:
    eng = llm.engine
    eng.add_request(None, [rng.randrange(3, 32000) for _ in range(n)], SamplingParams(max_tokens=1))
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [(1, 128), (8, 512), (32, 512), (8, 2048)] if not args.quick else [(1, 32), (4, 64)]
    steps = 5 if args.quick else 16
    rounds = 1 if args.quick else args.rounds
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write_checkpoint(path, dtype, seed=0)
        llms = {}
        for name, (opts, bf16_attention, fused) in VARIANTS.items():
            llms[name] = LLM(str(path), dtype=args.dtype, skip_tokenizer_init=True,
                             num_gpu_blocks=32 * 2100 // 16 + 64, max_num_batched_tokens=2048, **opts)
            switch_kernels(llms[name], bf16_attention, fused)
        check = [random.Random(5).randrange(3, 32000) for _ in range(200)]
        ref = None
        agree = {}
        for name, llm in llms.items():
            toks = llm.generate([check], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
            ref = ref or toks
            agree[name] = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), None)
            decode_step(llm, 2, 64, 3, random.Random(0))  # warm up
        res = {name: {c: [] for c in cases} | {"prefill": []} for name in llms}
        for r in range(rounds):
            for name, llm in llms.items():
                rng = random.Random(r)
                for c in cases:
                    res[name][c].append(decode_step(llm, *c, steps, rng))
                res[name]["prefill"].append(prefill(llm, 256 if args.quick else 1024, rng))
                print(f"round {r} {name}: " + ", ".join(f"{c[0]}x{c[1]} {statistics.median(res[name][c]) * 1e3:.1f} ms"
                                                       for c in cases), flush=True)
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in res.items()}
    base = med["portable"]
    rows = []
    for name in llms:
        cells = [name]
        for c in cases:
            t = med[name][c]
            cells.append(f"{t * 1e3:.1f} ms, {c[0] / t:,.0f} tok/s ({base[c] / t:.2f}x)")
        cells.append(f"{med[name]['prefill'] * 1e3:.0f} ms ({base['prefill'] / med[name]['prefill']:.2f}x)")
        cells.append("identical" if agree[name] is None else f"differs from token {agree[name]}")
        rows.append("| " + " | ".join(cells) + " |")
    header = (["variant"] + [f"decode B={b} ctx={c}" for b, c in cases]
              + [f"prefill {256 if args.quick else 1024} tok", "greedy tokens vs portable (32)"])
    cmd = "python benchmarks/bench_fastpath.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        f"## CPU fast paths vs portable, {args.dtype}, {datetime.datetime.now():%Y-%m-%d %H:%M}",
        "", f"`{cmd.strip()}` at {git_state()}; {cpu_model()}, {args.threads} threads; median of {rounds} "
        f"rounds x {steps} steps, variants round-robin in one process. Ratio = portable time / variant time.", "",
        "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows, ""])
    print(text)
    if not args.no_write and not args.quick:
        append_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
