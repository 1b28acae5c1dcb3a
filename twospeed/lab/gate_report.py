"""The gate for people: a console table per lane (rich) and OUT/gate.html, both read from the gate.json document,
so a report can be rebuilt from a saved gate. The two runs' own report.html pages sit beside it."""

from __future__ import annotations

import html
from pathlib import Path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _ci(ci: list | None) -> str:
    return "" if not ci else f" [{ci[0] * 100:.0f}-{ci[1] * 100:.0f}]"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def _num(x: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def lane_rows(lane: dict) -> list[tuple[str, str, str]]:
    """(what, baseline, candidate) rows of one lane."""
    g, rows = lane["gate"], []
    rows.append(("gate pass", f"{_pct(g['baseline']['rate'])}{_ci(g['baseline']['rate_ci'])}",
                 f"{_pct(g['candidate']['rate'])}{_ci(g['candidate']['rate_ci'])} "
                 f"(lost {g['paired']['lost']}, gained {g['paired']['gained']}, p={g['paired']['p_value']:.2g})"))
    for label, v in lane["latency_s"].items():
        rows.append((f"{label} ms", _ms(v["baseline"]), _ms(v["candidate"])))
    t = lane["output_tokens_per_s"]
    rows.append(("output tok/s", _num(t["baseline"]), _num(t["candidate"])))
    a = lane.get("agreement")
    if a:
        rows.append(("greedy exact match", "", f"{_pct(a['exact_match'])}{_ci(a['exact_match_ci'])} of {a['pairs']}; "
                                               f"first divergence p50 {_num(a['first_divergence_p50'], '{:.0f}')} tokens"))
    p = lane.get("probes")
    if p and p["probes"]:
        rows.append(("probe top-1 agreement", "", f"{_pct(p['top1_agreement'])}{_ci(p['top1_agreement_ci'])} "
                                                  f"of {p['probes']}"))
        rows.append(("probe KL (nats)", "", f"mean {p['kl_mean']:.4f}, p99 {p['kl_p99']:.4f}, max {p['kl_max']:.4f}"))
    kv = lane["kv_capacity"]
    cells = []
    for side in ("baseline", "candidate"):
        c = kv.get(side)
        cells.append("-" if not c else f"{c['max_tokens']:,} tokens ({c['kv_cache_dtype']}), "
                                       f"{_num(c['max_sequences'], '{:,.0f}')} seqs of "
                                       f"{_num(c['lane_tokens_p50'], '{:,.0f}')}")
    rows.append(("KV capacity", *cells))
    return rows


def verdict_line(name: str, lane: dict) -> str:
    v = lane["verdict"]
    if v["ship"]:
        return f"{name}: SHIP"
    return f"{name}: NO-SHIP: " + "; ".join(v["reasons"])


def print_gate(doc: dict, console) -> None:
    from rich.table import Table

    for name, lane in doc["lanes"].items():
        table = Table(title=f"lane {name}: baseline `{doc['baseline']['flags'] or '(defaults)'}` vs candidate "
                            f"`{doc['candidate']['flags'] or '(defaults)'}`")
        for col in ("", "baseline", "candidate"):
            table.add_column(col, justify="left" if not col else "right")
        for row in lane_rows(lane):
            table.add_row(*row)
        console.print(table)
        for note in lane["verdict"]["notes"]:
            console.print(f"  {note}", highlight=False)
    for name, lane in doc["lanes"].items():
        style = "green" if lane["verdict"]["ship"] else "red"
        console.print(f"[{style}]{verdict_line(name, lane)}[/]", highlight=False)
    console.print(f"[bold]{'SHIP' if doc['ship'] else 'NO-SHIP'}[/bold] (exit code {doc['exit_code']})")


def write_html(doc: dict, out: Path, baseline_folder: str) -> None:
    e = html.escape
    parts = [f"<h1>twospeed gate: {e(doc['model'])}, workload {e(doc['workload'])}, seed {doc['seed']}</h1>",
             f"<p>baseline <code>{e(doc['baseline']['flags'] or '(defaults)')}</code> &middot; candidate "
             f"<code>{e(doc['candidate']['flags'] or '(defaults)')}</code> &middot; "
             f"<b>{'SHIP' if doc['ship'] else 'NO-SHIP'}</b> (exit code {doc['exit_code']})</p>",
             f"<p>runs: <a href='{e(str(Path(baseline_folder).resolve()))}/report.html'>baseline</a>, "
             f"<a href='candidate/report.html'>candidate</a></p>"]
    for name, lane in doc["lanes"].items():
        v = lane["verdict"]
        color = "#1a7f37" if v["ship"] else "#cf222e"
        parts.append(f"<h2>lane {e(name)}: <span style='color:{color}'>{'ship' if v['ship'] else 'no-ship'}</span></h2>")
        if v["reasons"]:
            parts.append("<ul>" + "".join(f"<li><b>{e(r)}</b></li>" for r in v["reasons"]) + "</ul>")
        rows = "".join(f"<tr><td>{e(a)}</td><td>{e(b)}</td><td>{e(c)}</td></tr>" for a, b, c in lane_rows(lane))
        parts.append(f"<table><tr><th></th><th>baseline</th><th>candidate</th></tr>{rows}</table>")
        if v["notes"]:
            parts.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in v["notes"]) + "</ul>")
    style = ("<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}td:first-child{text-align:left}</style>")
    (out / "gate.html").write_text(f"<!doctype html><meta charset='utf-8'><title>twospeed gate</title>{style}"
                                   + "".join(parts))
