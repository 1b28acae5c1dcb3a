"""What the serving path costs in CPU, per streamed token: the HTTP front, the engine process and the client.

    .venv/bin/python benchmarks/bench_serving_cost.py                  # twospeed and vLLM, 1, 8 and 32 streams
    .venv/bin/python benchmarks/bench_serving_cost.py --engines twospeed --rounds 3

Each engine is served with benchmarks/peers/serve.py's settings; for each level N, N streams of one token-id
prompt (64 tokens) and `--tokens` greedy tokens each (EOS ignored) are read by one httpx client in this process.
Before and after, the CPU time (user + system, /proc) of the server's process (the front: HTTP, SSE, detokenizing)
and of its child processes (the engine), and this process's own (the client) are read; each is divided by the
streamed tokens. On two cores the front's and the client's CPU is taken from the engine's threads: their share of
the two cores during the run is what the served figure loses against the engine alone, beside what the engine's
own step costs. Never run it beside other work.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

from run_peers import machine  # noqa: E402
from serve import command_for, free_port, launch, served_name  # noqa: E402

from twospeed.engine.threads import process_cpu  # noqa: E402

PROMPT = list(range(100, 164))


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(p) for p in out]
    return kids + [d for k in kids for d in descendants(k)]


async def stream(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
    return events


async def streams(url: str, model: str, level: int, tokens: int) -> int:
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=level + 4)) as client:
        return sum(await asyncio.gather(*[stream(client, url, model, tokens) for _ in range(level)]))


def measure(server, level: int, tokens: int) -> dict:
    front, hz = server.process.pid, os.sysconf("SC_CLK_TCK")
    engine = descendants(front)
    before = {p: process_cpu(p, hz) for p in [front, *engine]}
    own, wall = os.times(), time.perf_counter()
    events = asyncio.run(streams(server.url, server.model, level, tokens))
    wall, own2 = time.perf_counter() - wall, os.times()
    spent = {p: process_cpu(p, hz) - before[p] for p in before}
    client = (own2.user + own2.system) - (own.user + own.system)
    n = level * tokens
    return {"level": level, "tok_s": n / wall, "events": events, "front_ms": spent[front] / n * 1e3,
            "engine_ms": sum(spent[p] for p in engine) / n * 1e3, "client_ms": client / n * 1e3,
            "front_share": spent[front] / wall / 2, "client_share": client / wall / 2}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="twospeed,vllm")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=256,
                    help="tokens per stream at level 1 (halved at 8, quartered at 32)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    print(f"# serving cost per streamed token — {machine()}", flush=True)
    rows = []
    for engine in args.engines.split(","):
        port = free_port()
        cmd, env = command_for(engine, "bf16", port)
        with launch(engine, "serving-cost", cmd, env, port, served_name("bf16")) as server:
            asyncio.run(streams(server.url, server.model, 2, 16))  # warm-up
            for level in levels:
                tokens = max(16, args.tokens // (1 if level == 1 else 2 if level <= 8 else 4))
                runs = [measure(server, level, tokens) for _ in range(args.rounds)]
                row = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "level"}
                rows.append((engine, level, row))
                print(f"  {engine} c{level}: {row['tok_s']:.1f} tok/s", flush=True)
    print("\n| engine | streams | out tok/s | CPU ms / token: front | engine | client "
          "| front + client, share of 2 cores |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for engine, level, r in rows:
        print(f"| {engine} | {level} | {r['tok_s']:.1f} | {r['front_ms']:.3f} | {r['engine_ms']:.2f} | "
              f"{r['client_ms']:.3f} | {100 * (r['front_share'] + r['client_share']):.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
