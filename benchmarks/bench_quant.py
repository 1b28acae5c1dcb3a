"""Quantization on the ~100M checkpoint: what int8 / fp8 weights and an int8 KV cache buy, against bf16 and
against llama.cpp's q8_0 of the same checkpoint, in one sitting. Not a test: run it on a quiet machine.

    .venv/bin/python benchmarks/bench_quant.py --checkpoint benchmarks/peers/.work/models/llama100m-bf16 \\
        --gguf benchmarks/peers/.work/models/llama100m-q8_0.gguf \\
        --llama-server benchmarks/peers/.work/llama-build/bin/llama-server --out /tmp/quant.md
    .venv/bin/python benchmarks/bench_quant.py --quick            # a smoke run on the demo model, no llama.cpp

Three parts:
1. In one process, round-robin (so drift hits every variant alike): batch-1 greedy decode tok/s and TTFT for
   bf16, int8, fp8 weights, and bf16 weights over an int8 KV cache, each an `LLM` on the same checkpoint;
   the roofline ratio = weight bytes read per second (weight_bytes x decode tok/s) / the measured copy
   bandwidth (twospeed/plan/hardware.py's measure_local).
2. Over HTTP with one client (benchmarks/peers/client.py), one server after another: `twospeed serve` bf16 and
   int8 and llama.cpp's `llama-server` on the q8_0 GGUF (made by benchmarks/peers/make_checkpoint.py), batch 1.
   llama.cpp runs with --no-repack: its repacked AMX q8_0 path crashed on this machine (see part2).
3. 32 concurrent long-context streams in one process, at the same KV memory budget: bf16 KV against int8 KV
   (tokens the pool holds, preemptions, output tok/s).
4. ("rows") the int8 kernels' crossover: the register kernel against the AMX one per row count.
Targets (the issue): int8 batch-1 decode >= 1.6x bf16 and >= llama.cpp q8_0; int8 KV >= 1.9x tokens in the
same memory and >= 1.3x output tok/s at 32 long-context streams.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

VARIANTS = {  # name -> LLM options
    "bf16": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "bf16 + int8 KV": {"kv_cache_dtype": "int8"},
}


@dataclass(slots=True)
class Config:
    checkpoint: str  # HF folder (the peers' llama100m-bf16) or "demo"
    gguf: str | None = None  # llama.cpp q8_0 GGUF of the same checkpoint
    llama_server: str | None = None  # llama-server binary
    prompt_tokens: int = 512  # batch-1 prompt
    output_tokens: int = 128  # batch-1 answer (EOS ignored)
    rounds: int = 5  # round-robin rounds in part 1, requests per server in part 2
    streams: int = 32  # part 3: concurrent long-context streams
    stream_prompt: int = 1536  # part 3: prompt tokens per stream
    stream_output: int = 64
    kv_gib: float = 0.4  # part 3: the KV budget both caches get (bf16 cannot hold all streams at once)
    threads: int = 2
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))


def prompts(tokenizer, n_tokens: int, count: int, salt: str) -> list[list[int]]:
    """Token-id prompts of exactly n_tokens (different per request, so nothing is served from the prefix cache)."""
    words = ("order refund invoice shipment customer status region policy update report ticket review payment "
             "latency deploy rollback service cluster metric alert owner team budget audit").split()
    out = []
    for i in range(count):
        text = f"{salt} request {i}: " + " ".join(words[(i + j) % len(words)] for j in range(n_tokens))
        out.append(tokenizer.encode(text, add_special_tokens=True)[:n_tokens])
    return out


def part1(cfg: Config) -> list[dict]:
    """Batch-1 decode tok/s and TTFT per variant, round-robin in this process."""
    from twospeed import LLM, SamplingParams
    from twospeed.plan.hardware import measure_local

    llms = {name: LLM(cfg.checkpoint, kv_cache_memory_gb=0.25, **VARIANTS[name]) for name in cfg.variants}
    first = next(iter(llms.values()))
    params = SamplingParams(max_tokens=cfg.output_tokens, temperature=0, ignore_eos=True)
    batches = prompts(first.tokenizer, cfg.prompt_tokens, cfg.rounds + 1, "b1")
    for llm in llms.values():  # warm-up: kernel builds, first-call allocations
        llm.generate([batches[0][:64]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    runs: dict[str, list] = {name: [] for name in llms}
    for r in range(cfg.rounds):
        for name, llm in llms.items():
            gc.collect()
            out = llm.generate([batches[r + 1]], params)[0]
            c = out.clock
            runs[name].append((c.ttft, (len(out.token_ids) - 1) / (c.ttlt - c.ttft)))
    bandwidth = measure_local("cpu", 1.5, ("bfloat16",)).copy_bandwidth
    rows = []
    for name, llm in llms.items():
        tok_s = statistics.median(t for _, t in runs[name])
        weights = llm.engine.model.weight_bytes()
        rows.append({"variant": name, "ttft_s": statistics.median(t for t, _ in runs[name]), "decode_tok_s": tok_s,
                     "weight_bytes": weights, "roofline": weights * tok_s / bandwidth, "bandwidth": bandwidth,
                     "kv_bytes_per_token": llm.engine.memory().kv_bytes_per_token})
    return rows


def part2(cfg: Config) -> list[dict]:
    """Batch 1 over HTTP, the same client for every server: twospeed bf16, twospeed int8, llama.cpp q8_0."""
    import serve
    from client import PromptMaker, request_body, run_concurrent

    # --no-repack: llama.cpp's repacked (AMX) q8_0 path segfaults on this machine's Sapphire Rapids cores at the
    # first matmul (its issue ggml-org/llama.cpp#20824, machine-dependent); its plain q8_0 kernels run
    settings = serve.Settings(threads=cfg.threads, max_num_seqs=4, kv_cache_gib=1, llama_args=["--no-repack"])
    tokenizer_dir = Path(cfg.checkpoint)
    servers = [("twospeed bf16", []), ("twospeed int8", ["--quantization", "int8"])]
    if cfg.gguf and cfg.llama_server:
        servers.append(("llama.cpp q8_0", None))
    rows = []
    for label, extra in servers:
        port = serve.free_port()
        cmd = (serve.twospeed_command(tokenizer_dir, "model", port, settings, extra) if extra is not None
               else serve.llama_command(Path(cfg.llama_server), Path(cfg.gguf), "model", port, settings))
        env = {"OMP_NUM_THREADS": str(cfg.threads)}
        with serve.launch("quant", label.replace(" ", "-"), cmd, env, port, "model", settings) as server:
            maker = PromptMaker(tokenizer_dir, f"q{port}")
            asyncio.run(run_concurrent(server.url, [request_body("model", maker.make(64, 0), 8)], 1))  # warm-up
            timings = []
            for i in range(cfg.rounds):
                body = request_body("model", maker.make(cfg.prompt_tokens, i + 1), cfg.output_tokens)
                timings += asyncio.run(run_concurrent(server.url, [body], 1))[0]
        rows.append({"server": label, "ttft_s": statistics.median(t.ttft_s for t in timings),
                     "decode_tok_s": statistics.median(t.decode_tok_s for t in timings)})
    return rows


def part3(cfg: Config) -> list[dict]:
    """32 long-context streams at once, one KV budget: bf16 KV against int8 KV."""
    from twospeed import LLM, SamplingParams

    rows = []
    for name, kv in (("bf16 KV", "auto"), ("int8 KV", "int8")):
        llm = LLM(cfg.checkpoint, kv_cache_memory_gb=cfg.kv_gib, kv_cache_dtype=kv, max_num_seqs=cfg.streams)
        engine = llm.engine
        params = SamplingParams(max_tokens=cfg.stream_output, temperature=0, ignore_eos=True)
        batch = prompts(llm.tokenizer, cfg.stream_prompt, cfg.streams, f"kv-{kv}")
        for ids in batch:
            engine.add_request(None, ids, params)
        t0, most_running, out_tokens = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            most_running = max(most_running, engine.last_stats.num_running)
            out_tokens += sum(len(o.new_token_ids) for o in outs)
        wall = time.perf_counter() - t0
        memory = engine.memory()
        rows.append({"cache": name, "pool_tokens": memory.max_tokens, "kv_bytes_per_token": memory.kv_bytes_per_token,
                     "most_running": most_running, "preemptions": engine.scheduler.num_preemptions,
                     "output_tok_s": out_tokens / wall, "wall_s": wall})
        del llm, engine
        gc.collect()
    return rows


def crossover(cfg: Config) -> list[dict]:
    """The int8 kernels' crossover: the register kernel against the AMX one per row count, single thread, min of 9
    (the decision behind quant.Q8_KERNEL_MAX_ROWS)."""
    import torch

    from twospeed.model.quant import Int8Format, Q8Kernel

    torch.set_num_threads(1)
    rows = []
    for n, k in ((2304, 768), (4096, 768), (768, 2048)):
        q, scale = Int8Format(True).quantize(torch.randn(n, k))
        kernel = Q8Kernel(q, scale, 0)
        if not kernel.amx:
            return []
        for m in (1, 2, 4, 6, 8, 16, 32):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            t = {}
            for wide in (False, True):
                best = float("inf")
                for _ in range(9):
                    t0 = time.perf_counter()
                    kernel.forward(x, None, wide=wide)
                    best = min(best, time.perf_counter() - t0)
                t[wide] = best
            rows.append({"shape": f"{k}x{n}", "rows": m, "register_ms": t[False] * 1e3, "amx_ms": t[True] * 1e3})
    torch.set_num_threads(cfg.threads)
    return rows


def markdown(cfg: Config, p1: list[dict], p2: list[dict], p3: list[dict], cross: list[dict] | None = None) -> str:
    lines = [f"### Quantization on {Path(cfg.checkpoint).name} ({cfg.threads} threads)", "",
             f"Batch 1, {cfg.prompt_tokens}-token prompt, {cfg.output_tokens} tokens out, median of {cfg.rounds} "
             "round-robin rounds in one process:", "",
             "| variant | decode tok/s | vs bf16 | TTFT ms | weight MB/step | roofline (weight B/s / copy B/s) |",
             "|---|---:|---:|---:|---:|---:|"]
    base = next((r["decode_tok_s"] for r in p1 if r["variant"] == "bf16"), None)
    for r in p1:
        ratio = f"{r['decode_tok_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['decode_tok_s']:.1f} | {ratio} | {r['ttft_s'] * 1e3:.0f} | "
                     f"{r['weight_bytes'] / 1e6:.0f} | {r['roofline']:.2f} |")
    if p1:
        lines += ["", f"Copy bandwidth measured: {p1[0]['bandwidth'] / 1e9:.1f} GB/s."]
    if p2:
        lines += ["", "Over HTTP, one server after another, the same client:", "",
                  "| server | decode tok/s | TTFT ms |", "|---|---:|---:|"]
        lines += [f"| {r['server']} | {r['decode_tok_s']:.1f} | {r['ttft_s'] * 1e3:.0f} |" for r in p2]
    if p3:
        lines += ["", f"{cfg.streams} streams of {cfg.stream_prompt} + {cfg.stream_output} tokens at once, "
                  f"{cfg.kv_gib} GiB of KV:", "",
                  "| cache | pool tokens | KV B/token | most running | preemptions | output tok/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['cache']} | {r['pool_tokens']:,} | {r['kv_bytes_per_token']:,} | {r['most_running']} | "
                  f"{r['preemptions']} | {r['output_tok_s']:.1f} |" for r in p3]
    if cross:
        lines += ["", "int8 kernels, single thread, min of 9: AMX time / register-kernel time by rows:", "",
                  "| shape | " + " | ".join(str(r["rows"]) for r in cross if r["shape"] == cross[0]["shape"]) + " |",
                  "|---|" + "---:|" * sum(r["shape"] == cross[0]["shape"] for r in cross)]
        for shape in dict.fromkeys(r["shape"] for r in cross):
            lines.append(f"| {shape} | " + " | ".join(f"{r['amx_ms'] / r['register_ms']:.2f}" for r in cross
                                                      if r["shape"] == shape) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="HF folder of the ~100M bf16 checkpoint (benchmarks/peers/make_checkpoint.py)")
    ap.add_argument("--gguf", help="llama.cpp q8_0 GGUF of the same checkpoint")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=Config.__dataclass_fields__["prompt_tokens"].default, help="batch-1 prompt length")
    ap.add_argument("--output-tokens", type=int, default=Config.__dataclass_fields__["output_tokens"].default,
                    help="batch-1 answer length")
    ap.add_argument("--parts", default="1,2,3,rows", help="which parts to run, e.g. 1,3 (rows: the int8 kernels' "
                    "crossover)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the demo model, tiny sizes, no HTTP part")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args()
    import torch

    if args.quick:
        cfg = Config("demo", prompt_tokens=32, output_tokens=8, rounds=1, streams=4, stream_prompt=200,
                     stream_output=4, kv_gib=0.005)
        parts = {"1", "3", "rows"}
    else:
        if not args.checkpoint:
            ap.error("--checkpoint is required (or --quick)")
        cfg = Config(args.checkpoint, args.gguf, args.llama_server, args.prompt_tokens, args.output_tokens, args.rounds)
        parts = set(args.parts.split(","))
    torch.set_num_threads(cfg.threads)
    p1 = part1(cfg) if "1" in parts else []
    p2 = part2(cfg) if "2" in parts else []
    p3 = part3(cfg) if "3" in parts else []
    cross = crossover(cfg) if "rows" in parts else []
    text = markdown(cfg, p1, p2, p3, cross)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
