"""/health latency while the server prepares hostile bodies: is anything slow left on the event loop?

Run:  .venv/bin/python benchmarks/bench_hostile.py [--url http://127.0.0.1:8000] [--repeats 3] [--scale 1.0]
          [--probe-interval-ms 5] [--json out.json]

Without --url it starts `twospeed serve --model demo` on a free port (OMP_NUM_THREADS=1) and stops it after.
Cases (sizes at --scale 1, as issue 11 names them):

  baseline   nothing but the probes;
  prompt     a /v1/completions prompt of 4 MB of text (refused as too long: the point is what it costs
             the loop on the way);
  chat       a /v1/chat/completions conversation of 40,000 messages (~2.7 MB of JSON);
  schema     a response_format JSON schema of ~150 KB (600 object properties), new each repeat, so it is
             validated and compiled every time (max_tokens 1).

For each case one client sends the hostile request while another probes GET /health back to back (a
sleep of --probe-interval-ms between probes) for as long as the hostile request is in flight; the report
gives the probes' p50, p99 and max and the hostile request's own time and status, per case over all
repeats. The target (issue 11): p99 < 50 ms in every case, on a quiet machine. The loop-blocking cost
of each step is bounded by its longest GIL-holding C call (a JSON slice, a pydantic item, the
tokenizer's list of ids), which is why the p99 of the probes, not the mean, is the number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import httpx

from twospeed.engine.request import percentile


def hostile_bodies(scale: float) -> dict[str, tuple[str, dict]]:
    words = "latency throughput prefill decode token cache block schedule request stream batch".split()
    prompt = (" ".join(words) + " ") * int(4_000_000 * scale / 70)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: {words[i % len(words)]}"}
                for i in range(int(40_000 * scale))]
    return {"prompt": ("/v1/completions", {"model": "demo", "prompt": prompt, "max_tokens": 1}),
            "chat": ("/v1/chat/completions", {"model": "demo", "messages": messages, "max_tokens": 1})}


def schema_body(scale: float) -> tuple[str, dict]:
    salt = uuid.uuid4().hex  # a new schema each time: validated and compiled, never a cache hit
    props = {f"field_{i}": {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {
        "a": {"type": "string", "maxLength": 20, "description": f"{salt} " + "x" * 60},
        "b": {"type": "integer", "minimum": 0, "maximum": i + 1}, "c": {"enum": ["p", "q", "r"]}}}
        for i in range(int(600 * scale))}
    schema = {"type": "object", "additionalProperties": False, "properties": props,
              "required": [f"field_{i}" for i in range(0, len(props), 50)]}
    rf = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    return "/v1/completions", {"model": "demo", "prompt": "fill the form", "max_tokens": 1, "response_format": rf}


async def run_case(base: str, case: tuple[str, bytes] | None, interval: float) -> tuple[list[float], float, int]:
    """(/health latencies in seconds while the hostile request was in flight, its own time, its status).
    The hostile request goes out from a thread, already encoded, so that its client work does not delay the
    probes on this event loop."""
    done = threading.Event()
    result: dict = {}

    def hostile() -> None:
        time.sleep(0.2)  # probes first, so the whole preparation is covered
        t = time.perf_counter()
        if case is None:
            time.sleep(1.0)
            result["status"] = 200
        else:
            path, body = case
            with httpx.Client(timeout=300) as client:
                result["status"] = client.post(f"{base}{path}", content=body,
                                               headers={"content-type": "application/json"}).status_code
        result["elapsed"] = time.perf_counter() - t
        done.set()

    sender = threading.Thread(target=hostile, daemon=True)
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=120) as probe:
        sender.start()
        while not done.is_set():
            t = time.perf_counter()
            r = await probe.get(f"{base}/health")
            latencies.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            await asyncio.sleep(interval)
    sender.join()
    return latencies, result["elapsed"], result["status"]


def pct(values: list[float], p: float) -> float:
    return percentile(sorted(values), p)


def start_server() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "twospeed.cli", "serve", "--model", "demo", "--port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    for line in proc.stdout:
        if m := re.search(r"serving .* at (http://\S+)/v1", line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running twospeed server (default: start one on the demo model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every hostile size (smoke test: 0.01)")
    parser.add_argument("--probe-interval-ms", type=float, default=5.0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    proc, base = (None, args.url.rstrip("/").removesuffix("/v1")) if args.url else start_server()
    try:
        bodies = hostile_bodies(args.scale)
        results = {}
        for name in ("baseline", "prompt", "chat", "schema"):
            lat, times, statuses = [], [], []
            for _ in range(args.repeats):
                case = None if name == "baseline" else schema_body(args.scale) if name == "schema" else bodies[name]
                case = case and (case[0], json.dumps(case[1]).encode())
                got, elapsed, status = asyncio.run(run_case(base, case, args.probe_interval_ms / 1e3))
                lat += got
                times.append(elapsed)
                statuses.append(status)
            results[name] = {"probes": len(lat), "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
                             "max_ms": max(lat) * 1e3, "request_s": sorted(times)[len(times) // 2],
                             "status": sorted(set(statuses))}
        print(f"{'case':<10} {'probes':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'request s':>10}  status")
        for name, r in results.items():
            print(f"{name:<10} {r['probes']:>7} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} "
                  f"{r['request_s']:>10.2f}  {r['status']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"scale": args.scale, "repeats": args.repeats, "results": results}, f, indent=2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
