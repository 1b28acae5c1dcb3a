"""What one /metrics scrape costs both sides: the server's render and the lab's parse, against the libraries' own.

Run:  .venv/bin/python benchmarks/bench_exposition.py [--lanes 5] [--repeat 30]

A server's registry as a `mixed` run leaves it (default + four lanes, each histogram observed), rendered by
prometheus_client's generate_latest and by server/exposition.py (byte-identical text, checked), then parsed by
prometheus_client's parser whole (what the lab did) and by lab/scrape.parse (bucket lines dropped first; same
sums, checked). Both sides run on the machine the engine steps on, so on a small one every scrape is a co-tenant.
Median of `repeat` calls each, in the same process and sitting; the ratios are the result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from twospeed.lab import scrape  # noqa: E402
from twospeed.server.metrics import ServerMetrics  # noqa: E402


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def full_parse(text: str) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lanes", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    lanes = ("default", *(f"lane{i}" for i in range(1, args.lanes)))
    metrics = ServerMetrics("bench", lanes=lanes)
    for lane in lanes:
        for i in range(200):
            for hist, scale in ((metrics.ttft, 0.01), (metrics.itl, 0.001), (metrics.e2e, 0.05)):
                hist.labels(lane, "bench").observe(scale * (1 + i % 50))
    text = metrics.render()
    assert text == generate_latest(metrics.registry), "the exposition must be generate_latest's text"
    lines = text.count(b"\n")
    render_lib = timed(lambda: generate_latest(metrics.registry), args.repeat)
    render_ours = timed(metrics.render, args.repeat)
    decoded = text.decode()
    parse_lib = timed(lambda: full_parse(decoded), max(3, args.repeat // 5))
    parse_ours = timed(lambda: scrape.parse(decoded), args.repeat)
    print(f"exposition: {lines:,} lines, {len(text) / 1024:,.0f} KiB ({args.lanes} lanes)")
    print("| side | library | twospeed | ratio |\n|---|---:|---:|---:|")
    print(f"| server render | {render_lib * 1e3:.1f} ms | {render_ours * 1e3:.1f} ms | "
          f"{render_lib / render_ours:.1f}x |")
    print(f"| lab parse | {parse_lib * 1e3:.1f} ms | {parse_ours * 1e3:.1f} ms | {parse_lib / parse_ours:.1f}x |")


if __name__ == "__main__":
    main()
