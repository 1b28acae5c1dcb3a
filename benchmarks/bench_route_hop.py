"""The route hop's own cost, without Ray, engines or HTTP: what route_time is made of when nothing else runs.

Run:  .venv/bin/python benchmarks/bench_route_hop.py [--requests 400] [--prompt-tokens 900] [--hogs 0]
          [--hog-nice 0] [--hop-nice 0] [--pause-ms 30]

Two processes, as in a cluster: an "ingress" that does what the cluster client does between a request's
arrival and its send (the Admission, the prefix router's choice over the prompt's block-hash chain, a frame on the
replica's channel), and a "replica" whose ChannelServer runs a generate() that stamps route_time exactly as
EngineReplica.generate does and answers Admitted. Requests go one at a time, a random pause apart (`--pause-ms`),
so every hop starts from sleeping processes (the common case at a few requests a second); 0 sends them back to
back.

Printed: route_time p50/p90/p99/max, and the ingress's own part (arrival -> frame written: the router's hashing
and the pickling), so the rest is the wake-ups and the loopback TCP. `--hogs N` starts N CPU-bound processes
(niceness `--hog-nice`) beside the hop (niceness `--hop-nice`): how the hop's tail grows when engines hold the
cores, and what niceness buys. Ray workers run at niceness 15 unless told otherwise (RAY_worker_niceness).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twospeed.cluster.channel import Channel, ChannelServer  # noqa: E402
from twospeed.cluster.router import PrefixRouter, ReplicaLoad  # noqa: E402
from twospeed.engine.sampling_params import SamplingParams  # noqa: E402
from twospeed.serving.request_group import SequenceSpec  # noqa: E402
from twospeed.serving.request_group import Admission  # noqa: E402
from twospeed.serving.wire import Admitted, Load  # noqa: E402


def replica(port_queue: mp.Queue, nice: int) -> None:
    os.nice(nice)

    async def generate(routed: Admission):
        yield Admitted(max(0.0, time.time() - routed.arrival_time), Load(0, 0, 0.0, 0))

    async def main() -> None:
        server = ChannelServer(generate)
        port_queue.put(await server.start("127.0.0.1"))
        await asyncio.Event().wait()

    asyncio.run(main())


def hog(nice: int) -> None:
    os.nice(nice)
    x = 0
    while True:
        x += 1


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def ingress(address, args) -> tuple[list[float], list[float]]:
    rng = random.Random(0)
    router = PrefixRouter(2, 16, [4096, 4096])
    loads = [ReplicaLoad(), ReplicaLoad()]
    system = [rng.randrange(8192) for _ in range(args.prompt_tokens * 2 // 3)]  # the shared part, as in `agent`
    channel = Channel(address)
    route, own = [], []
    for i in range(args.requests + 10):
        prompt = system + [rng.randrange(8192) for _ in range(args.prompt_tokens - len(system))]
        await asyncio.sleep(rng.uniform(0.5, 1.5) * args.pause_ms / 1e3)
        arrival, arrival_unix = time.monotonic(), time.time()
        specs = [SequenceSpec(f"r{i}", prompt, SamplingParams(max_tokens=64), 0)]
        routed = Admission("agent", 0, arrival_unix, specs)
        decision = router.choose(prompt, loads)
        stream = await channel.open(routed)
        sent = time.monotonic()
        first = await stream.__anext__()
        router.record(decision.replica, prompt)
        stream.cancel()
        if i >= 10:  # the first ones warm the connection and the caches
            route.append(first.route_time * 1e3)
            own.append((sent - arrival) * 1e3)
    channel.close()
    return route, own


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside the hop (engines' stand-ins)")
    ap.add_argument("--hog-nice", type=int, default=0)
    ap.add_argument("--hop-nice", type=int, default=0, help="niceness of both ends of the hop")
    ap.add_argument("--pause-ms", type=float, default=30.0, help="mean pause between requests (0: back to back)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=replica, args=(ports, args.hop_nice), daemon=True)]
    procs += [ctx.Process(target=hog, args=(args.hog_nice,), daemon=True) for _ in range(args.hogs)]
    for p in procs:
        p.start()
    address = ports.get(timeout=30)
    os.nice(args.hop_nice)
    try:
        route, own = asyncio.run(ingress(address, args))
    finally:
        for p in procs:
            p.kill()
    print(f"{args.requests} hops, prompt {args.prompt_tokens} tokens, {args.hogs} hogs at nice {args.hog_nice}, "
          f"hop at nice {args.hop_nice}")
    for name, v in (("route_time", route), ("ingress part", own)):
        print(f"  {name:12s} p50 {pct(v, 0.5):6.2f}  p90 {pct(v, 0.9):6.2f}  p99 {pct(v, 0.99):6.2f}  "
              f"max {max(v):6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
