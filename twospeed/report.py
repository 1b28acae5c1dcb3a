"""Render the split clock and the split bill of finished requests as rich tables."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from twospeed.engine.request import RequestOutput, percentile


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f}"


def request_table(outputs: Sequence[RequestOutput], labels: Sequence[str] | None = None) -> Table:
    """One row per request: its bill (tokens by kind) and its clock (ms)."""
    t = Table(title="Per request: split bill (tokens) and split clock (ms)", title_justify="left")
    for name in ("request", "prompt", "cached", "prefilled", "output", "recomp",
                 "queue", "prefill", "TTFT", "ITL p50", "ITL p99", "TPOT", "TTLT", "interfered", "finish"):
        t.add_column(name, justify="left" if name in ("request", "finish") else "right")
    for i, o in enumerate(outputs):
        c, b = o.clock.summary(), o.bill
        label = labels[i] if labels else o.request_id
        steps = f"{o.clock.interfered_steps}/{o.clock.decode_steps}"
        t.add_row(label, str(b.prompt_tokens), str(b.cached_tokens), str(b.prefilled_tokens), str(b.output_tokens),
                  str(b.recomputed_tokens), _ms(c["queue_time"]), _ms(c["prefill_time"]), _ms(c["ttft"]),
                  _ms(c["itl_p50"]), _ms(c["itl_p99"]), _ms(c["tpot"]), _ms(c["ttlt"]), steps, o.finish_reason or "")
    return t


def totals_table(outputs: Sequence[RequestOutput], wall_time: float) -> Table:
    """Percentiles of every clock field over all requests, and the summed bill."""
    t = Table(title="Totals", title_justify="left")
    for name in ("metric", "p50", "p90", "p99", "max"):
        t.add_column(name, justify="left" if name == "metric" else "right")
    series = {
        "queue (ms)": [o.clock.queue_time for o in outputs],
        "prefill (ms)": [o.clock.prefill_time for o in outputs],
        "TTFT (ms)": [o.clock.ttft for o in outputs],
        "ITL, every token (ms)": [gap for o in outputs for gap in o.clock.itl],
        "TPOT (ms)": [o.clock.tpot for o in outputs],
        "TTLT (ms)": [o.clock.ttlt for o in outputs],
    }
    for name, values in series.items():
        v = sorted(x for x in values if x is not None)
        t.add_row(name, *(_ms(percentile(v, p)) for p in (50, 90, 99)), _ms(v[-1] if v else None))
    prompt = sum(o.bill.prompt_tokens for o in outputs)
    cached = sum(o.bill.cached_tokens for o in outputs)
    prefilled = sum(o.bill.prefilled_tokens for o in outputs)
    output = sum(o.bill.output_tokens for o in outputs)
    recomputed = sum(o.bill.recomputed_tokens for o in outputs)
    t.add_section()
    t.add_row("bill: prompt = cached + prefilled", f"{prompt:,}", f"{cached:,}", f"{prefilled:,}", "")
    t.add_row("bill: output / recomputed", f"{output:,}", f"{recomputed:,}", "", "")
    t.add_row("throughput (tok/s): prompt / output", f"{prompt / wall_time:,.0f}", f"{output / wall_time:,.0f}",
              "", f"wall {wall_time:.2f} s")
    return t


def print_report(outputs: Sequence[RequestOutput], wall_time: float, labels: Sequence[str] | None = None,
                 console: Console | None = None) -> None:
    console = console or Console()
    console.print(request_table(outputs, labels))
    console.print(totals_table(outputs, wall_time))
