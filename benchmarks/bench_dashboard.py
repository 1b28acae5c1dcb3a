"""What /dashboard costs: the page's load time on loopback, and the server's step time with the page open vs closed.

Run:  .venv/bin/python benchmarks/bench_dashboard.py [--phase-seconds 20] [--pairs 3] [--concurrency 4]
          [--loads 5] [--history-requests N] [--json out.json]

It starts `twospeed serve --model demo` on a free port (OMP_NUM_THREADS=1) and keeps a steady closed-loop
load on it (--concurrency streams, each a 64-token prompt and 48 output tokens, ignore_eos) for the whole run.
Then:

  load     headless Chromium (Debian's chromium, as the browser test drives it) opens /dashboard --loads times,
           each in a fresh page with a cold cache, with the history holding what the load left so far; the
           time from navigation to the first rendered update (every panel drawn), min / median;
  overhead --pairs pairs of phases of --phase-seconds each, page closed then open (order alternating, so a drift
           of the machine cancels): the mean engine step time and steps per second in each phase, from the
           server's own history (the step_time column of /dashboard/data), and open / closed as a ratio;
  listener the history's own cost per engine event, measured in this process (min of 5 repeats of 20,000
           step events and 2,000 finish events): it is paid whether a page is open or not.

Targets (issue 17): load < 1 s on loopback; open / closed step time < 1.02. Timings need a quiet machine; the
ratios come from phases run side by side in one sitting. --smoke runs tiny sizes end to end (no numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import httpx

BROWSER = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class Load:
    """--concurrency closed-loop streams against the server until stop()."""

    def __init__(self, url: str, concurrency: int):
        self.url, self._stop = url, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            k = 0
            while not self._stop.is_set():
                client.post(f"{self.url}/completions", json={
                    "model": "demo", "prompt": "a steady load for the dashboard benchmark " * 6 + f"{i}.{k}",
                    "max_tokens": 48, "ignore_eos": True, "lane": ("chat", "batch")[i % 2]})
                k += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(130)


def step_times(base: str, since: float) -> list[float]:
    d = httpx.get(f"{base}/dashboard/data", params={"since": since}, timeout=30).json()
    return [t for t in d["steps"]["step_time"] if t is not None]


def server_now(base: str) -> float:
    return httpx.get(f"{base}/dashboard/data", params={"since": -0.001}, timeout=30).json()["now"]


def measure_loads(ctx, base: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        page = ctx.new_page()
        start = time.perf_counter()
        page.goto(f"{base}/dashboard")
        page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=60_000)
        out.append(time.perf_counter() - start)
        page.close()
        ctx.clear_cookies()
    return out


def phase(base: str, seconds: float, ctx) -> dict:
    """One phase: a page open (ctx given) or none; the engine's steps in it."""
    page = None
    if ctx is not None:
        page = ctx.new_page()
        page.goto(f"{base}/dashboard")
        page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=60_000)
    t0 = server_now(base)
    time.sleep(seconds)
    steps = step_times(base, t0)
    if page is not None:
        page.close()
    return {"open": ctx is not None, "steps": len(steps),
            "mean_step_ms": 1e3 * statistics.fmean(steps) if steps else None, "p50_step_ms": 1e3 * statistics.median(steps) if steps else None, "steps_per_s": len(steps) / seconds}


def listener_cost() -> dict:
    """Microseconds the history spends per event (min of 5 repeats), in this process."""
    from twospeed.engine.engine_stats import StepStats
    from twospeed.engine.request import Request
    from twospeed.engine.sampling_params import SamplingParams
    from twospeed.serving.events import FinishEvent, StepEvent
    from twospeed.server.history import History
    from twospeed.schema.slo import Verdict

    stats = StepStats(time=0.0, step_time=0.03, num_prefill_tokens=64, num_decode_tokens=4, num_running=4,
                      num_waiting=1, num_preempted=0, kv_blocks_used=10, kv_blocks_total=96, kv_cached_blocks=5)
    req = Request("r", list(range(64)), SamplingParams(max_tokens=48), arrival_time=0.0, max_output_tokens=48)
    req.clock.first_scheduled, req.clock.prefill_done = 0.01, 0.05
    for k in range(48):
        req.append_token(1, 0.06 + 0.03 * k)
    req.clock.finished = 1.5
    best_step = best_finish = float("inf")
    for _ in range(5):
        h = History()
        t = time.perf_counter()
        for _ in range(20_000):
            h.on_event(StepEvent(stats))
        best_step = min(best_step, (time.perf_counter() - t) / 20_000)
        t = time.perf_counter()
        for _ in range(2_000):
            h.on_event(FinishEvent("chat", req, False, Verdict("chat", True)))
        best_finish = min(best_finish, (time.perf_counter() - t) / 2_000)
    return {"us_per_step_event": best_step * 1e6, "us_per_finish_event_48_tokens": best_finish * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase-seconds", type=float, default=20.0)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--history-requests", type=int, default=4096)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, end to end (the numbers mean nothing)")
    args = ap.parse_args()
    if args.smoke:
        args.phase_seconds, args.pairs, args.loads, args.concurrency = 2.0, 1, 1, 2
    os.environ["OMP_NUM_THREADS"] = "1"
    from playwright.sync_api import sync_playwright

    from twospeed.lab.local_server import LocalServer
    from twospeed.builtin.demo import demo_checkpoint_path

    demo_checkpoint_path()
    result = {"args": vars(args), "listener": listener_cost()}
    with LocalServer("demo", ["--history-requests", str(args.history_requests)]) as server, sync_playwright() as p:
        base = server.url.removesuffix("/v1")
        ctx = p.chromium.launch_persistent_context(tempfile.mkdtemp(prefix="bench-dashboard-"), executable_path=BROWSER,
                                                   headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000})
        load = Load(server.url, args.concurrency)
        try:
            time.sleep(args.phase_seconds)  # warm up; the history fills
            loads = measure_loads(ctx, base, args.loads)
            phases = []
            for i in range(args.pairs):
                order = (None, ctx) if i % 2 == 0 else (ctx, None)
                phases += [phase(base, args.phase_seconds, c) for c in order]
        finally:
            load.stop()
            ctx.close()
    closed = [ph["mean_step_ms"] for ph in phases if not ph["open"] and ph["mean_step_ms"]]
    opened = [ph["mean_step_ms"] for ph in phases if ph["open"] and ph["mean_step_ms"]]
    result.update(load_s={"min": min(loads), "median": statistics.median(loads), "all": loads}, phases=phases,
                  open_over_closed=statistics.fmean(opened) / statistics.fmean(closed) if closed and opened else None)
    print(f"page load (navigation -> first render, loopback): min {min(loads) * 1e3:.0f} ms, "
          f"median {statistics.median(loads) * 1e3:.0f} ms  (target < 1000 ms)")
    for ph in phases:
        print(f"  page {'open  ' if ph['open'] else 'closed'}: {ph['steps']} steps, mean {ph['mean_step_ms']:.2f} ms, "
              f"p50 {ph['p50_step_ms']:.2f} ms, {ph['steps_per_s']:.1f} steps/s")
    if result["open_over_closed"] is not None:
        print(f"step time, page open / closed: {result['open_over_closed']:.4f}  (target < 1.02)")
    lc = result["listener"]
    print(f"history listener: {lc['us_per_step_event']:.2f} us per step event, "
          f"{lc['us_per_finish_event_48_tokens']:.1f} us per finished 48-token sequence")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
