"""A bf16 checkpoint served with `dtype: auto` against `dtype: bfloat16`, beside HF transformers in the dtype
auto picks, same sitting (model/compute_dtype.py).

Run:  .venv/bin/python benchmarks/bench_dtype.py [--prompt 256] [--new 32] [--threads 2] [--no-write]

On a CPU with bf16 kernels (AVX-512 BF16, AMX) auto is bf16 and the two twospeed rows are the same engine. On one
without (AVX2), auto computes in float32 and the bf16 row shows what serving the checkpoint's dtype costs there.
Single stream on bench_engine's ~100M random Llama (written in bf16): TTFT of one prompt, decode tok/s from the
request's own clock (1 / tpot), and the greedy tokens' agreement with twospeed auto's; a row with int8 weights
(`--quantization int8`: on AVX2 the same widening kernel over one byte a weight). Appends a section to
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_engine import (append_report, cpu_model, hf_single, load_hf, make_llm, random_prompt, ts_single,  # noqa: E402
                          warm_llm, write_checkpoint)

from twospeed.model.compute_dtype import auto_dtype  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_twospeed(path: Path, dtype: str, prompt: list[int], n: int, **options) -> dict:
    llm = make_llm(path, dtype, **options)
    warm_llm(llm, random.Random(1))
    row = ts_single(llm, prompt, n)
    row["dtype"] = str(llm.engine.dtype).removeprefix("torch.")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="generated tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompt = random_prompt(random.Random(0), args.prompt)
    picked = auto_dtype(torch.bfloat16, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        params = write_checkpoint(path, torch.bfloat16, seed=0)
        rows = {"twospeed auto": run_twospeed(path, "auto", prompt, args.new),
                "twospeed bfloat16": run_twospeed(path, "bfloat16", prompt, args.new),
                "twospeed auto, int8 weights": run_twospeed(path, "auto", prompt, args.new, quantization="int8")}
        hf = load_hf(path, picked)
        hf_single(hf, prompt[:32], 2)  # warm-up
        rows[f"HF {str(picked).removeprefix('torch.')}"] = {**hf_single(hf, prompt, args.new),
                                                            "dtype": str(picked).removeprefix("torch.")}
    ref = rows["twospeed auto"]["tokens"]
    lines = ["| engine | computes in | TTFT (ms) | decode tok/s | tokens equal to twospeed auto |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["tokens"], ref))
        lines.append(f"| {name} | {r['dtype']} | {r['ttft'] * 1e3:.0f} | {r['decode_tps']:.1f} | {same}/{len(ref)} |")
    auto, bf16 = rows["twospeed auto"], rows["twospeed bfloat16"]
    hf_row = rows[f"HF {str(picked).removeprefix('torch.')}"]
    lines.append("")
    lines.append(f"auto / bfloat16: TTFT {auto['ttft'] / bf16['ttft']:.3f}x, "
                 f"decode {auto['decode_tps'] / bf16['decode_tps']:.2f}x; auto / HF: TTFT "
                 f"{auto['ttft'] / hf_row['ttft']:.2f}x, decode {auto['decode_tps'] / hf_row['decode_tps']:.2f}x")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        section = (f"## {stamp} — bench_dtype: a bf16 checkpoint with dtype auto vs bfloat16\n\n"
                   f"- command: `.venv/bin/python benchmarks/bench_dtype.py --prompt {args.prompt} --new {args.new} "
                   f"--threads {args.threads}`\n- CPU: {cpu_model()}; torch threads: {args.threads}\n"
                   f"- model: bench_engine's random Llama, {params / 1e6:.1f}M parameters, written in bfloat16; "
                   f"batch 1, prompt {args.prompt}, {args.new} greedy tokens\n\n{table}\n")
        append_report(ROOT / "BENCHMARKS.md", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
