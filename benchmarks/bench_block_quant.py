"""Block-quantized weights (q8_0, q4_0, q4_1, q4_k, gguf): what each format buys at batch 1, against the baseline
dtype, int8 and llama.cpp's llama-server on the same GGUF file, in one sitting. Not a test: run it on a quiet
machine (two cores; nothing else running).

    .venv/bin/python benchmarks/bench_block_quant.py --model smollm2 --out /tmp/block.md      # the built-in Q4_1 file
    .venv/bin/python benchmarks/bench_block_quant.py --model path/to/model-Q4_0.gguf --formats gguf,q4_0,q8_0
    .venv/bin/python benchmarks/bench_block_quant.py --model path/to/hf-folder --parts kernels,engine  # bf16/fp32
    .venv/bin/python benchmarks/bench_block_quant.py --quick         # smoke: the demo model, tiny sizes, no peer

Three parts (--parts):
1. kernels: each format's linear at batch 1 (and 8 rows) over the model's own shapes, enough copies cycled that the
   weights stream from memory: bytes read per second over the copy bandwidth, measured in the same run by
   twospeed.plan.hardware.measure_local (as benchmarks/bench_roofline.py does; a copy counts read + write bytes, as
   STREAM's does), before and after, the better taken. The issue's target: >= 70% for every kernel. Beside the
   model's shapes, batch 1 through one 64 MiB linear: the kernel's streaming rate without a small call's fixed cost.
2. engine: one `LLM` per variant in this process, round-robin (drift hits every variant alike): batch-1 greedy decode
   tok/s and TTFT; roofline = the model's weight bytes x decode tok/s / copy bandwidth; speed-up over the baseline
   (the checkpoint in the dtype twospeed computes it in). Targets: 4-bit >= 2.5x, 8-bit >= 1.7x the bf16 baseline.
3. served: `twospeed serve --quantization F` on the GGUF against `llama-server` on the same file (benchmarks/peers's
   settings; its build from benchmarks/peers/setup.sh), one after the other, at 1, 8 and 32 concurrent streams:
   decode tok/s per stream (median), output tok/s over the run, TTFT p50. Target: 4-bit >= 1.1x llama.cpp at 1.
   llama-server runs with its own defaults (its repacked CPU kernels included); --llama-arg adds flags.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import torch  # noqa: E402

BLOCK = ("q8_0", "q4_0", "q4_1", "q4_k")
LLAMA_SERVER = ROOT / "benchmarks/peers/.work/llama-build/bin/llama-server"  # benchmarks/peers/setup.sh builds it


@dataclass(slots=True)
class Config:
    model: str  # a GGUF file, an HF folder, "smollm2" or "demo"
    formats: list[str] = field(default_factory=lambda: ["int8", *BLOCK, "gguf"])  # beside the baseline
    parts: list[str] = field(default_factory=lambda: ["kernels", "engine", "served"])
    prompt_tokens: int = 512
    output_tokens: int = 128
    rounds: int = 5
    kernel_mib: int = 256  # weights per format in the kernel part: well past the last-level cache
    kernel_calls: int = 200
    streams: list[int] = field(default_factory=lambda: [1, 8, 32])
    served_formats: list[str] = field(default_factory=lambda: ["gguf"])
    requests_per_stream: int = 2  # served: requests = streams x this (at least rounds at 1 stream)
    llama_server: Path = LLAMA_SERVER
    llama_args: list[str] = field(default_factory=list)
    threads: int = 2


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and Path(path).is_file()


# -- 1. kernels ---------------------------------------------------------------------------------------------------
def kernel_variants(dtype: torch.dtype) -> dict[str, tuple[str | None, torch.dtype]]:
    """name -> (quantization, stored dtype): the baseline, bf16 kept bf16 where the CPU computes in float32, int8."""
    out = {str(dtype).removeprefix("torch."): (None, dtype)}
    if dtype == torch.float32:
        out["bf16 (widened)"] = (None, torch.bfloat16)
    return out


def part_kernels(cfg: Config, model_cfg, dtype: torch.dtype, bandwidth: float) -> list[dict]:
    """Each format's linear, 1 and 8 rows, over the model's shapes, streamed from memory. The K-quants (q4_k, and
    Q6_K as a file stores it: random bytes, `gguf` keeps them) take each width rounded up to whole 256-blocks, so
    they run their own kernels where the model's widths are not whole super-blocks."""
    from twospeed.model.weight_format import make_weight_format

    h, q = model_cfg.hidden_size, model_cfg.num_heads * model_cfg.head_dim
    kv, i = model_cfg.num_kv_heads * model_cfg.head_dim, model_cfg.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]  # (out, in) of one layer
    variants = {**kernel_variants(dtype), **{f: (f, dtype) for f in cfg.formats if f != "gguf"}}
    if "gguf" in cfg.formats:
        variants["q6_k"] = ("gguf", dtype)
    rows = []
    for name, (quantization, stored) in variants.items():
        fmt = make_weight_format(quantization, "auto", "cpu", dtype, stored)
        own = [(n, -(-k // 256) * 256) for n, k in shapes] if name in ("q4_k", "q6_k") else shapes
        per_layer = sum(variant_nbytes(name, fmt, n, k, stored) for n, k in own)
        copies = max(1, cfg.kernel_mib * 2**20 // per_layer)
        try:
            linears = [variant_linear(name, fmt, n, k, dtype, stored, seed) for seed in range(copies) for n, k in own]
        except ValueError as e:  # a width that is not whole blocks
            rows.append({"variant": name, "error": str(e)})
            continue
        nbytes = sum(lin.nbytes for lin in linears) / len(linears)
        for m in (1, 8):
            xs = [torch.randn(m, lin.in_features, dtype=dtype) for lin in linears[:len(shapes)]]
            dt = time_calls([lin.forward for lin in linears], xs * copies, cfg.kernel_calls)
            entries = [c_entry(lin, m) for lin in linears]
            dc = None if None in entries else time_calls(entries, xs * copies, cfg.kernel_calls)
            rows.append({"variant": name, "rows": m, "us_per_call": dt * 1e6, "gb_s": nbytes / dt / 1e9, "shapes": own,
                         "of_copy": nbytes / dt / bandwidth, "describe": linears[0].describe(),
                         **({} if dc is None else {"c_us": dc * 1e6, "c_gb_s": nbytes / dc / 1e9,
                                                   "c_of_copy": nbytes / dc / bandwidth})})
        del linears
        gc.collect()
        rows[-2].update(stream_rate(fmt, name, own, dtype, stored, bandwidth))
    return rows


def stream_rate(fmt, name: str, shapes: list[tuple[int, int]], dtype: torch.dtype, stored: torch.dtype,
                bandwidth: float) -> dict:
    """Batch 1 through two 64 MiB linears of the widest input, each call streaming one from memory: the kernel's
    own streaming rate, without the fixed cost a small linear's call pays (the Python call into C, the threads'
    fork and join, the stream's start), which the model-shape rows include."""
    k = max(k for _, k in shapes)
    n = 64 * 2**20 // variant_nbytes(name, fmt, 1, k, stored) // 8 * 8
    linears = [variant_linear(name, fmt, n, k, dtype, stored, seed) for seed in range(2)]
    xs = [torch.randn(1, k, dtype=dtype) for _ in linears]
    entries = [c_entry(lin, 1) for lin in linears]
    fns = [lin.forward for lin in linears] if None in entries else entries
    dt = time_calls(fns, xs, 20)
    nbytes = sum(lin.nbytes for lin in linears) / len(linears)
    del linears
    gc.collect()
    return {"big_gb_s": nbytes / dt / 1e9, "big_of_copy": nbytes / dt / bandwidth, "big_shape": (n, k)}


def time_calls(fns: list, xs: list[torch.Tensor], at_least: int) -> float:
    """Seconds per call of fns[i](xs[i]) cycled in order (one warm-up pass), over at least `at_least` calls."""
    for fn, x in zip(fns, xs):
        fn(x)
    t0, calls = time.perf_counter(), 0
    while calls < at_least:
        for fn, x in zip(fns, xs):
            fn(x)
        calls += len(fns)
    return (time.perf_counter() - t0) / calls


def c_entry(lin, m: int):
    """x [m, K] float32 -> lin's C kernels through the entries the decode graph calls (csrc/graph.h), without
    the module's Python and torch dispatch (what the engine's decode steps pay); None where it has none."""
    import ctypes

    from twospeed.model.decode_graph import _Linear

    calls = lin.graph_calls() if hasattr(lin, "graph_calls") else None
    if not calls:
        return None
    run = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Linear), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_int, ctypes.c_int)
    ops = [(run(c.run), _Linear(c.run, c.weight, c.scale, c.bias, c.col, c.kind, c.out_features, c.in_features))
           for c in calls]
    y, threads = torch.empty(m, lin.out_features), torch.get_num_threads()

    def call(x: torch.Tensor) -> None:
        for fn, op in ops:
            fn(ctypes.byref(op), x.data_ptr(), x.stride(0), y.data_ptr() + 4 * op.col, y.stride(0), m, threads)
    return call


def make_linear(fmt, n: int, k: int, dtype: torch.dtype, stored: torch.dtype, seed: int):
    """A loaded linear of `fmt` with random weights (values of `stored`), built as load_model builds one."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        lin = fmt.linear(k, n, False)
    finally:
        torch.set_default_dtype(prev)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(stored)
    lin.weight.weight_loader(lin.weight, w.to(lin.weight.dtype) if lin.weight.is_floating_point() else w)
    lin.finish_loading()
    return lin


def variant_nbytes(name: str, fmt, n: int, k: int, stored: torch.dtype) -> int:
    """Bytes of an n x k weight of the kernel table's variant `name` (q6_k: a file's Q6_K bytes)."""
    from twospeed.model.block_kinds import KINDS

    return n * KINDS["Q6_K"].row_bytes(k) if name == "q6_k" else fmt.weight_nbytes(n, k, stored)


def variant_linear(name: str, fmt, n: int, k: int, dtype: torch.dtype, stored: torch.dtype, seed: int):
    """A loaded linear of the kernel table's variant `name` with random weights."""
    return q6_k_linear(fmt, n, k, seed) if name == "q6_k" else make_linear(fmt, n, k, dtype, stored, seed)


def q6_k_linear(fmt, n: int, k: int, seed: int):
    """A `gguf` linear holding random Q6_K bytes (small finite fp16 d), as a file's Q6_K tensor is loaded."""
    from twospeed.model.block_kinds import KINDS, BlockTensor

    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * k // 256, 210), dtype=torch.uint8, generator=g)
    raw[:, 208:210] = (torch.rand(raw.shape[0], 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    lin = fmt.linear(k, n, False)
    lin.load_weight(lin.weight, BlockTensor(KINDS["Q6_K"], raw.reshape(n, -1), (n, k)))
    lin.finish_loading()
    return lin


# -- 2. engine ----------------------------------------------------------------------------------------------------
def part_engine(cfg: Config, path: str, bandwidth: float) -> list[dict]:
    """Batch-1 decode tok/s and TTFT per variant, round-robin in this process."""
    from twospeed import LLM, SamplingParams

    names = ["baseline", *cfg.formats]
    if not is_gguf(path):
        names = [n for n in names if n != "gguf"]  # the file's own formats: a GGUF only
    llms = {}
    for name in names:
        kw = {} if name == "baseline" else {"quantization": name}
        try:
            llms[name] = LLM(path, kv_cache_memory_gb=0.25, cost_probe=False, skip_tokenizer_init=True, **kw)
        except ValueError as e:  # a width that is not whole blocks
            print(f"engine: {name} skipped: {e}", flush=True)
    first = next(iter(llms.values()))
    vocab = first.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(cfg.prompt_tokens)] for _ in range(cfg.rounds + 1)]
    params = SamplingParams(max_tokens=cfg.output_tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():  # warm-up: kernel builds, first-call allocations
        llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    runs: dict[str, list] = {name: [] for name in llms}
    for r in range(cfg.rounds):
        for name, llm in llms.items():
            gc.collect()
            out = llm.generate([prompts[r + 1]], params)[0]
            c = out.clock
            runs[name].append((c.ttft, (len(out.token_ids) - 1) / max(c.ttlt - c.ttft, 1e-9)))
    rows = []
    for name, llm in llms.items():
        tok_s = statistics.median(t for _, t in runs[name])
        weights = llm.engine.model.weight_bytes()
        rows.append({"variant": name, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                     "ttft_s": statistics.median(t for t, _ in runs[name]), "decode_tok_s": tok_s,
                     "weight_mb": weights / 1e6, "roofline": weights * tok_s / bandwidth})
    base = next((r["decode_tok_s"] for r in rows if r["variant"] == "baseline"), None)
    for r in rows:
        r["speedup"] = r["decode_tok_s"] / base if base else None
    return rows


# -- 3. served ----------------------------------------------------------------------------------------------------
def part_served(cfg: Config, gguf: Path) -> list[dict]:
    """twospeed (each served format) and llama-server on the same GGUF, at each stream count."""
    import serve
    from client import PromptMaker, request_body, run_concurrent

    from twospeed.model.tokenizer import Tokenizer

    class Prompts(PromptMaker):  # PromptMaker's prompts, counted by the file's own tokenizer
        def __init__(self, salt: str):
            self.tokenizer, self.salt, self.rng = Tokenizer.from_pretrained(gguf).backend, salt, random.Random(0)

    settings = serve.Settings(threads=cfg.threads, max_num_seqs=max(cfg.streams), kv_cache_gib=1,
                              llama_args=list(cfg.llama_args))
    servers = [(f"twospeed {f}", ["--quantization", f]) for f in cfg.served_formats]
    if cfg.llama_server.exists():
        servers.append(("llama.cpp", None))
    else:
        print(f"served: no {cfg.llama_server} (benchmarks/peers/setup.sh builds it): twospeed only", flush=True)
    rows = []
    for label, extra in servers:
        port = serve.free_port()
        cmd = (serve.twospeed_command(gguf, "model", port, settings, extra) if extra is not None
               else serve.llama_command(cfg.llama_server, gguf, "model", port, settings))
        env = {"OMP_NUM_THREADS": str(cfg.threads)}
        with serve.launch("block", label.replace(" ", "-"), cmd, env, port, "model", settings) as server:
            maker = Prompts(f"b{port}")
            asyncio.run(run_concurrent(server.url, [request_body("model", maker.make(32, 0), 4)], 1))  # warm-up
            for streams in cfg.streams:
                n = max(streams * cfg.requests_per_stream, cfg.rounds if streams == 1 else 0)
                bodies = [request_body("model", maker.make(cfg.prompt_tokens, 1000 * streams + j), cfg.output_tokens)
                          for j in range(n)]
                timings, wall = asyncio.run(run_concurrent(server.url, bodies, streams))
                rows.append({"server": label, "streams": streams, "requests": n,
                             "ttft_s": statistics.median(t.ttft_s for t in timings),
                             "decode_tok_s": statistics.median(t.decode_tok_s for t in timings),
                             "output_tok_s": sum(t.output_tokens for t in timings) / wall})
    return rows


# -- report -------------------------------------------------------------------------------------------------------
def report(cfg: Config, path: str, probes: list, kernels: list[dict], engine: list[dict], served: list[dict]) -> str:
    bw = max(p.copy_bandwidth for p in probes)
    lines = [f"## Block-quantized weights on {Path(path).name}, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"{cfg.threads} threads; copy bandwidth (best of {len(probes)} probes) {bw / 1e9:.1f} GB/s "
             f"(read + write bytes).", ""]
    if kernels:
        def c(r: dict) -> str:
            return (f"{r['c_us']:.0f} | {r['c_gb_s']:.1f} | {r['c_of_copy']:.0%}" if "c_us" in r else "— | — | —")
        def big(r: dict) -> str:
            return f"{r['big_gb_s']:.1f} | {r['big_of_copy']:.0%}" if "big_gb_s" in r else "— | —"
        lines += table("| kernel | rows | us / call | GB/s read | of copy bandwidth | C entry: us | GB/s | of copy "
                       "| 64 MiB linear: GB/s | of copy | path |", [
            f"| {r['variant']} | — | — | — | — | — | — | — | — | — | {r['error']} |" if "error" in r else
            f"| {r['variant']} | {r['rows']} | {r['us_per_call']:.0f} | {r['gb_s']:.1f} | {r['of_copy']:.0%} | "
            f"{c(r)} | {big(r)} | {r['describe']} |" for r in kernels])
        rounded = next((r["shapes"] for r in kernels if r["variant"] in ("q4_k", "q6_k") and "shapes" in r), None)
        if rounded:
            lines += [f"The K-quant rows' (out, in) shapes, widths rounded up to whole 256-blocks: {rounded}.", ""]
    if engine:
        lines += table("| variant | dtype | weights | TTFT | decode tok/s | x baseline | roofline |", [
            f"| {r['variant']} | {r['dtype']} | {r['weight_mb']:.0f} MB | {r['ttft_s'] * 1e3:.0f} ms | "
            f"{r['decode_tok_s']:.1f} | {times(r['speedup'])} | "
            f"{r['roofline']:.0%} |" for r in engine])
    if served:
        lines += table("| server | streams | requests | TTFT p50 | decode tok/s per stream | output tok/s |", [
            f"| {r['server']} | {r['streams']} | {r['requests']} | {r['ttft_s'] * 1e3:.0f} ms | "
            f"{r['decode_tok_s']:.1f} | {r['output_tok_s']:.1f} |" for r in served])
    return "\n".join(lines)


def times(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def table(header: str, rows: list[str]) -> list[str]:
    """A markdown table: the first column left-aligned, the rest right."""
    cols = header.count("|") - 1
    return [header, "|---|" + "---:|" * (cols - 1), *rows, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF file, an HF folder, smollm2 or demo")
    ap.add_argument("--formats", default=None, help="comma-separated, beside the baseline (default: all)")
    ap.add_argument("--parts", default="kernels,engine,served")
    ap.add_argument("--served-formats", default="gguf", help="what `twospeed serve` runs the GGUF as")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernel-mib", type=int, default=256)
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    ap.add_argument("--llama-arg", action="append", default=[], help="an extra llama-server flag (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: demo model, tiny sizes, no served part")
    ap.add_argument("--out", type=Path, default=None, help="markdown file to append to (default: print only)")
    args = ap.parse_args(argv)
    cfg = Config(model=args.model, parts=args.parts.split(","), served_formats=args.served_formats.split(","),
                 streams=[int(s) for s in args.streams.split(",")], prompt_tokens=args.prompt_tokens,
                 output_tokens=args.output_tokens, rounds=args.rounds, kernel_mib=args.kernel_mib,
                 llama_server=args.llama_server, llama_args=args.llama_arg, threads=args.threads)
    if args.formats:
        cfg.formats = args.formats.split(",")
    if args.quick:
        cfg.model = "demo" if args.model == "smollm2" else args.model
        cfg.parts = [p for p in cfg.parts if p != "served"]
        cfg.prompt_tokens, cfg.output_tokens, cfg.rounds, cfg.kernel_mib, cfg.kernel_calls = 16, 4, 1, 4, 8
        cfg.streams, cfg.requests_per_stream = [1, 2], 1
    torch.set_num_threads(cfg.threads)
    from twospeed.builtin.registry import resolve_model_path
    from twospeed.model.compute_dtype import auto_dtype
    from twospeed.model.loader import load_model_config
    from twospeed.plan.hardware import measure_local

    path = str(resolve_model_path(cfg.model))  # a built-in (demo, smollm2) is built or fetched once
    model_cfg = load_model_config(path)
    dtype = auto_dtype(model_cfg.dtype, "cpu")
    probe_s = 0.5 if args.quick else 3.0
    probes = [measure_local("cpu", probe_s, (str(dtype).removeprefix("torch."),))]
    bw = probes[0].copy_bandwidth
    kernels = part_kernels(cfg, model_cfg, dtype, bw) if "kernels" in cfg.parts else []
    engine = part_engine(cfg, path, bw) if "engine" in cfg.parts else []
    probes.append(measure_local("cpu", probe_s, (str(dtype).removeprefix("torch."),)))
    if kernels or engine:  # fractions against the better of the two probes
        best = max(p.copy_bandwidth for p in probes)
        for r in kernels + engine:
            for key in ("of_copy", "c_of_copy", "roofline"):
                if key in r:
                    r[key] *= bw / best
    served = []
    if "served" in cfg.parts:
        if is_gguf(path):
            served = part_served(cfg, Path(path))
        else:
            print("served: the peer runs a GGUF file; --model is not one", flush=True)
    text = report(cfg, path, probes, kernels, engine, served)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
