"""`twospeed compare RUN_A RUN_B [...]`: one workload against several configurations, lane by lane.

Each later run is set against the first (the baseline): TTFT and ITL (p50, p99; ITL max), gate pass rate, SLO
attainment, goodput and the bill, with the difference and whether it is beyond the noise: the 95% bootstrap
intervals of the two percentiles (or Wilson intervals of the two rates) do not overlap. Token counts are
exact, so they have no noise column. Then the trade chunked prefill makes, one row per run (`trade`): the ITL
p99 and max of the decode lanes against the TTFT p99 of the long-prompt lane (the one with the most prompt
tokens per request), beside output tok/s: a step budget sized for the streams stretches the long prompt's
TTFT, one sized for the prompt stalls the streams. Job lanes add the job's wall time and its parts, tokens per turn, the
cache hit and job goodput, and a turn-by-turn table (prompt, cached, prefill). Runs of different workloads
or seeds are refused unless forced; runs that differ only in harness policy (summarized dumps, a stable or
unstable prefix) compare, and the policy of each is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from twospeed.lab import results, stats

# (row label, path into a lane summary, interval path or None, unit scale, unit, lower is better)
ROWS = (
    ("TTFT p50", ("stats", "ttft", "p50"), ("stats", "ttft", "p50_ci"), 1e3, "ms", True),
    ("TTFT p99", ("stats", "ttft", "p99"), ("stats", "ttft", "p99_ci"), 1e3, "ms", True),
    ("ITL p50", ("stats", "itl", "p50"), ("stats", "itl", "p50_ci"), 1e3, "ms", True),
    ("ITL p99", ("stats", "itl", "p99"), ("stats", "itl", "p99_ci"), 1e3, "ms", True),
    ("ITL max", ("stats", "itl", "max"), None, 1e3, "ms", True),  # one long prefill's stall shows here first
    ("queue p99", ("stats", "queue", "p99"), ("stats", "queue", "p99_ci"), 1e3, "ms", True),
    ("gate pass", ("gate", "rate"), ("gate", "rate_ci"), 100, "%", False),
    ("SLO attainment", ("slo", "attainment"), ("slo", "attainment_ci"), 100, "%", False),
    ("goodput tokens", ("goodput", "tokens"), None, 1, "", False),
    ("cached input", ("bill", "cached_tokens"), None, 1, "", False),
    ("prefilled input", ("bill", "prefilled_tokens"), None, 1, "", True),
    ("output tokens", ("bill", "output_tokens"), None, 1, "", False),
    ("cost", ("bill", "total_usd"), None, 1, "$", True),
    ("requests/s", ("throughput", "requests_per_s"), None, 1, "/s", False),
    ("output tok/s", ("throughput", "output_tokens_per_s"), None, 1, "/s", False),
    ("TPOT p50", ("stats", "tpot", "p50"), ("stats", "tpot", "p50_ci"), 1e3, "ms", True),
    ("steps/token", ("spec", "steps_per_token"), None, 1, "", True),  # speculation and jump-forward lower it
    ("spec accepted", ("spec", "accepted"), None, 1, "", False),
    ("spec proposed", ("spec", "proposed"), None, 1, "", False),
    ("acceptance length", ("spec", "mean_acceptance_length"), None, 1, "", False),
)
# Job lanes only: a job's wall time and where it went, tokens per turn (a turn is one call), job goodput
JOB_ROWS = (
    ("job wall p50", ("jobs", "stats", "wall", "p50"), ("jobs", "stats", "wall", "p50_ci"), 1, "s", True),
    ("job wall p99", ("jobs", "stats", "wall", "p99"), ("jobs", "stats", "wall", "p99_ci"), 1, "s", True),
    *((f"job {p} (mean)", ("jobs", "stats", p, "mean"), None, 1, "s", True)
      for p in ("queue", "prefill", "decode", "tool", "gate")),
    ("prefill per turn p50", ("stats", "prefill", "p50"), ("stats", "prefill", "p50_ci"), 1e3, "ms", True),
    ("prompt tokens/turn", ("jobs", "per_call", "prompt_tokens"), None, 1, "", True),
    ("prefilled tokens/turn", ("jobs", "per_call", "prefilled_tokens"), None, 1, "", True),
    ("cache hit", ("jobs", "per_call", "hit_rate"), None, 100, "%", False),
    ("jobs in window", ("jobs", "window", "attainment"), ("jobs", "window", "attainment_ci"), 100, "%", False),
    ("job goodput", ("jobs", "goodput", "rate"), ("jobs", "goodput", "rate_ci"), 100, "%", False),
)


@dataclass(slots=True)
class Cell:
    value: float | None
    diff: float | None = None  # this run - baseline, in display units
    significant: bool | None = None  # beyond the noise (None: no interval to judge by)


def _get(d: dict, path: tuple) -> object:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def check_comparable(docs: list[dict], force: bool = False) -> None:
    """Refuse runs of different workloads (by content digest) or seeds unless forced."""
    base = docs[0]["run"]
    for doc in docs[1:]:
        run = doc["run"]
        for key, what in (("workload_digest", "workloads"), ("seed", "seeds")):
            if run[key] != base[key] and not force:
                raise ValueError(f"runs have different {what} ({base.get('workload')}/{base[key]} vs "
                                 f"{run.get('workload')}/{run[key]}); pass --force to compare anyway")


def compare(docs: list[dict]) -> dict[str, list[tuple[str, list[Cell]]]]:
    """lane -> [(row label, one Cell per run)] for lanes present in every run, then 'all'."""
    lanes = [name for name in docs[0]["lanes"] if all(name in d["lanes"] for d in docs[1:])]
    table = {}
    for lane in [*lanes, "all"]:
        summaries = [d["total"] if lane == "all" else d["lanes"][lane] for d in docs]
        rows = []
        for label, path, ci_path, scale, _, _ in ROWS + (JOB_ROWS if all(s.get("jobs") for s in summaries) else ()):
            base = _get(summaries[0], path)
            cells = []
            for i, s in enumerate(summaries):
                v = _get(s, path)
                cell = Cell(None if v is None else v * scale)
                if i and v is not None and base is not None:
                    cell.diff = (v - base) * scale
                    if ci_path:
                        ov = stats.overlaps(_get(s, ci_path), _get(summaries[0], ci_path))
                        cell.significant = None if ov is None else not ov
                cells.append(cell)
            rows.append((label, cells))
        table[lane] = rows
    return table


def trade(docs: list[dict]) -> tuple[str | None, list[str], list[dict]]:
    """(the long-prompt lane, the decode lanes, one row per run: {lane: (ITL p99, ITL max) s, long lane: TTFT p99 s,
    "output_tok_s"}). The long-prompt lane has the most prompt tokens per request in the base run; the decode
    lanes are the others that streamed (an ITL observed) in every run."""
    lanes = [name for name in docs[0]["lanes"] if all(name in d["lanes"] for d in docs[1:])]

    def prompt_per_request(lane: str) -> float:
        s = docs[0]["lanes"][lane]
        return (_get(s, ("bill", "prompt_tokens")) or 0) / max(1, s.get("requests") or 0)

    if not lanes:
        return None, [], []
    long = max(lanes, key=prompt_per_request)
    decode = [name for name in lanes if name != long
              and all(_get(d["lanes"][name], ("stats", "itl", "n")) for d in docs)]
    rows = []
    for d in docs:
        row = {name: (_get(d["lanes"][name], ("stats", "itl", "p99")), _get(d["lanes"][name], ("stats", "itl", "max")))
               for name in decode}
        row[long] = _get(d["lanes"][long], ("stats", "ttft", "p99"))
        row["output_tok_s"] = _get(d["total"], ("throughput", "output_tokens_per_s"))
        rows.append(row)
    return long, decode, rows


def trade_table(docs: list[dict], names: list[str]):
    from rich.table import Table

    long, decode, rows = trade(docs)
    table = Table(title=f"the trade: decode lanes' ITL p99 / max against {long}'s TTFT p99 (ms)")
    table.add_column("run")
    for name in decode:
        table.add_column(f"{name} ITL", justify="right")
    table.add_column(f"{long} TTFT p99", justify="right")
    table.add_column("output tok/s", justify="right")
    ms = lambda v: _fmt(None if v is None else v * 1e3, "")  # noqa: E731
    for name, row in zip(names, rows):
        table.add_row(name, *(f"{ms(row[n][0])} / {ms(row[n][1])}" for n in decode), ms(row[long]),
                      _fmt(row["output_tok_s"], ""))
    return table


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "$":
        return f"${v:.4f}"
    if unit in ("s", "/s"):
        return f"{v:,.2f}{unit}"
    return f"{v:,.1f}{unit}" if unit else f"{v:,.0f}"


def print_comparison(docs: list[dict], console) -> None:
    from rich.table import Table

    names = [d["run"].get("label") or d["run"]["url"] for d in docs]
    units = {label: (unit, lower) for label, _, _, _, unit, lower in ROWS + JOB_ROWS}
    for lane, rows in compare(docs).items():
        table = Table(title=f"lane {lane}" if lane != "all" else "all lanes")
        table.add_column("")
        table.add_column(names[0] + " (base)", justify="right")
        for n in names[1:]:
            table.add_column(n, justify="right")
            table.add_column("diff", justify="right")
        for label, cells in rows:
            unit, lower = units[label]
            row = [label, _fmt(cells[0].value, unit)]
            for c in cells[1:]:
                row.append(_fmt(c.value, unit))
                if c.diff is None:
                    row.append("-")
                    continue
                better = (c.diff < 0) == lower
                mark = "" if c.significant is None else (" (noise)" if not c.significant else
                                                         (" [green]better[/]" if better else " [red]worse[/]"))
                row.append(f"{'+' if c.diff >= 0 else '-'}{_fmt(abs(c.diff), unit)}{mark}")
            table.add_row(*row)
        console.print(table)
        if lane != "all" and all(d["lanes"][lane].get("jobs") for d in docs):
            console.print(turn_table(docs, lane, names))
    console.print("diff: run - base; 'better'/'worse' where the 95% intervals do not overlap, '(noise)' where they do.")
    if trade(docs)[1]:
        console.print(trade_table(docs, names))
    for line in policy_lines(docs, names):
        console.print(line, highlight=False)


def turn_table(docs: list[dict], lane: str, names: list[str]):
    """Turn by turn, per run: mean prompt tokens, cached tokens and prefill time of the lane's jobs."""
    from rich.table import Table

    table = Table(title=f"lane {lane}: per turn (mean prompt tokens / cached / prefill ms)")
    table.add_column("turn", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    turns = [{t["turn"]: t for t in d["lanes"][lane]["jobs"]["turns"]} for d in docs]
    for k in sorted(set().union(*turns)):
        cells = []
        for by_turn in turns:
            t = by_turn.get(k)
            cells.append("-" if t is None else f"{t['prompt_tokens']:,.0f} / {t['cached_tokens']:,.0f} / "
                                               f"{_fmt(None if t['prefill_s'] is None else t['prefill_s'] * 1e3, 'ms')}")
        table.add_row(str(k), *cells)
    return table


def policy_lines(docs: list[dict], names: list[str]) -> list[str]:
    """The harness policy of each run, per lane, where the runs differ in it."""
    lines = []
    for lane in docs[0]["lanes"]:
        policies = [(d["lanes"].get(lane) or {}).get("policy") for d in docs]
        if all(p == policies[0] for p in policies):
            continue
        for name, p in zip(names, policies):
            if p is not None:
                s = p.get("summarize")
                lines.append(f"policy of {name}, lane {lane}: prefix {'stable' if p['prefix_stable'] else 'unstable'}, "
                             f"dumps {'kept whole' if not s else 'summarized to %d tokens (%s)' % (s['max_tokens'], s['by'])}")
    return lines


def load_runs(paths: list[str], force: bool = False) -> list[dict]:
    if len(paths) < 2:
        raise ValueError("compare needs at least two runs")
    docs = [results.load(p) for p in paths]
    check_comparable(docs, force)
    return docs
