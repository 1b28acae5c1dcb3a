"""The engine's memory across a long run of distinct prompts: RSS every N requests.

    .venv/bin/python benchmarks/bench_soak.py                         # served demo, 5,000 requests, RSS per 500
    .venv/bin/python benchmarks/bench_soak.py --in-process --requests 1500 --every 250
    .venv/bin/python benchmarks/bench_soak.py --env MALLOC_ARENA_MAX=2   # an allocator setting to compare

Served (the default) starts `twospeed serve` and reads the engine process's RSS (the server's child) and the
HTTP process's; --in-process drives an LLMEngine in this process and reads its own. Every prompt has a length
drawn from [--min-len, --max-len] and fresh random token ids: distinct prompts, so no prefix-cache hit keeps a
step's shape, and every chunk's row count is new as often as the traffic makes it. Output is short (4 tokens
by default): the point is the prefill path's allocations, where the shapes vary. RSS after the first --every
requests is the baseline (the KV pool, the weights and the kernels' caches have filled by then); the table
prints each reading and its growth against the reading at half the run, the "flat from half to the end"
figure BENCHMARKS.md records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent


def rss_mb(proc: psutil.Process) -> float:
    return proc.memory_info().rss / 2**20


def prompts(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    # ids under 8,000: inside every built-in vocabulary (the demo models have 8,192)
    return [[rng.randrange(100, 8000) for _ in range(rng.randint(args.min_len, args.max_len))]
            for _ in range(args.requests)]


def engine_args(args) -> dict:
    return dict(num_gpu_blocks=args.blocks, max_model_len=args.max_len + 64, max_num_seqs=args.concurrency,
                dtype=args.dtype, **{k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.engine)})


def run_in_process(args, readings: list[tuple[int, float, float | None]]) -> None:
    import gc

    from twospeed import LLM, SamplingParams

    llm = LLM(args.model, **engine_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    me = psutil.Process()
    todo = prompts(args)
    for start in range(0, len(todo), args.every):
        llm.generate(todo[start:start + args.every], params)
        gc.collect()
        readings.append((start + args.every, rss_mb(me), None))
        print(f"{start + args.every:>6} requests: {readings[-1][1]:.0f} MB", flush=True)
    heap = llm.engine.heap
    print(f"heap trims: {heap.num_trims}, {1000 * heap.trim_time_s / max(1, heap.num_trims):.1f} ms each")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_child(server: psutil.Process) -> psutil.Process:
    """The engine process: the server's child with the largest RSS (the others are helpers, if any)."""
    kids = server.children(recursive=True)
    if not kids:
        raise RuntimeError("the server has no engine process")
    return max(kids, key=rss_mb)


async def drive(base: str, todo: list[list[int]], args, server: psutil.Process,
                readings: list[tuple[int, float, float | None]]) -> None:
    sem = asyncio.Semaphore(args.concurrency)
    done = 0
    lock = asyncio.Lock()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def one(ids: list[int]) -> None:
            nonlocal done
            async with sem:
                r = await client.post("/v1/completions", json={
                    "model": args.model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True})
                r.raise_for_status()
            async with lock:
                done += 1
                if done % args.every == 0:
                    eng = engine_child(server)
                    readings.append((done, rss_mb(eng), rss_mb(server)))
                    print(f"{done:>6} requests: engine {readings[-1][1]:.0f} MB, http {readings[-1][2]:.0f} MB",
                          flush=True)

        await asyncio.gather(*(one(ids) for ids in todo))


def run_served(args, readings: list[tuple[int, float, float | None]]) -> None:
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args(args).items()]
    cmd = [str(ROOT / ".venv/bin/twospeed"), "serve", "--model", args.model, "--port", str(port),
           "--log-level", "warning", *flags]
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    proc = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(1)
        asyncio.run(drive(base, prompts(args), args, psutil.Process(proc.pid), readings))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=450)
    ap.add_argument("--max-len", type=int, default=750)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=400, help="KV pool blocks (small: the pool fills early)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--engine", action="append", default=[], help="KEY=VALUE: another engine option, the value as JSON")
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (served runs)")
    args = ap.parse_args()
    readings: list[tuple[int, float, float | None]] = []
    t0 = time.perf_counter()
    (run_in_process if args.in_process else run_served)(args, readings)
    wall = time.perf_counter() - t0
    half = next((r for r in readings if r[0] >= args.requests // 2), readings[0])
    print(f"\n{'in-process' if args.in_process else 'served'} {args.model}, {args.requests} requests of "
          f"{args.min_len}-{args.max_len} prompt tokens, {args.max_tokens} out, {args.concurrency} at a time, "
          f"{wall:.0f} s; dtype {args.dtype}; env {' '.join(args.env) or '-'}; engine {' '.join(args.engine) or '-'}")
    print("| requests | engine RSS (MB) | vs half-way | HTTP process RSS (MB) |")
    print("|---:|---:|---:|---:|")
    for n, eng, http in readings:
        http_cell = f"{http:.0f}" if http is not None else "-"
        print(f"| {n} | {eng:.0f} | {100 * (eng / half[1] - 1):+.1f}% | {http_cell} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
