"""A run for people: the console summary (rich) and report.html with PNG plots (matplotlib, Agg).

Plots: TTFT vs prompt tokens (prefill's cost), ITL vs token position (decode's), CDFs of TTFT and ITL per
lane, tokens per engine step over time when the server exposes them, and for job lanes a stacked bar of a
job's time (queue / prefill / decode / tool / gate) and the prompt's growth and cache hit turn by turn. The
page ends with the diagnosis and the server dashboard's views of the run (dashboard.html, report_dashboard.py).
Everything is read from the results.json document, so a report can be rebuilt from a saved run.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def summary_rows(doc: dict) -> list[list[str]]:
    rows = []
    for name, lane in [*doc["lanes"].items(), ("all", doc["total"])]:
        s = lane["stats"]
        rows.append([name, str(lane["requests"]), str(lane["errors"]), _ms(s["ttft"]["p50"]), _ms(s["ttft"]["p99"]),
                     _ms(s["itl"]["p50"]), _ms(s["itl"]["p99"]), _ms(s["tpot"]["p50"]), _ms(s["queue"]["p99"]),
                     _pct(lane["gate"]["rate"]), _pct(lane["slo"]["attainment"]),
                     f"{lane['goodput']['tokens']:,}", f"{lane['bill']['cached_tokens']:,}",
                     f"{lane['bill']['prefilled_tokens']:,}", f"{lane['bill']['output_tokens']:,}",
                     f"${lane['bill']['total_usd']:.4f}"])
    return rows


HEADERS = ["lane", "reqs", "err", "TTFT p50 ms", "TTFT p99", "ITL p50 ms", "ITL p99", "TPOT p50", "queue p99",
           "gate", "SLO", "goodput tok", "cached in", "prefilled in", "output", "cost"]
JOB_PARTS = ("queue", "prefill", "decode", "tool", "gate", "other")
JOB_HEADERS = ["job lane", "jobs", "err", "calls/job", "wall p50 s", "wall p99 s", *JOB_PARTS, "last-turn prompt",
               "cache hit", "in window", "good jobs"]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def job_rows(doc: dict) -> list[list[str]]:
    """One row per job lane: the wall time, the share of each part, prompt growth, window and goodput."""
    rows = []
    for name, lane in doc["lanes"].items():
        j = lane.get("jobs")
        if not j:
            continue
        turns = j["turns"]
        cached = sum(t["cached_tokens"] * t["calls"] for t in turns)
        prompt = sum(t["prompt_tokens"] * t["calls"] for t in turns)
        rows.append([name, str(j["jobs"]), str(j["errors"]), f"{j['calls']['mean'] or 0:.1f}",
                     _s(j["stats"]["wall"]["p50"]), _s(j["stats"]["wall"]["p99"]),
                     *(_pct(j["share"].get(p)) for p in JOB_PARTS),
                     f"{turns[-1]['prompt_tokens']:,.0f}" if turns else "-", _pct(cached / prompt if prompt else None),
                     _pct(j["window"]["attainment"]), f"{j['goodput']['jobs']}/{j['jobs']}"])
    return rows


def throughput_line(doc: dict) -> str:
    """Request and output-token throughput over the run's wall time, in total and per lane."""
    def one(s: dict) -> str:
        t = s.get("throughput") or {}
        req, tok = t.get("requests_per_s"), t.get("output_tokens_per_s")
        return "-" if req is None else f"{req:.2f} req/s, {tok:,.1f} output tok/s"

    lanes = "; ".join(f"{n} {one(s)}" for n, s in doc["lanes"].items())
    return f"throughput over {doc['run']['wall_s']:.1f} s: {one(doc['total'])} ({lanes})"


def spec_line(doc: dict) -> str | None:
    """Per lane: engine steps per output token, and where the server speculated, drafts kept of verified and the
    mean acceptance length; None when no lane has either."""
    parts = []
    for name, lane in doc["lanes"].items():
        s = lane.get("spec") or {}
        if s.get("steps_per_token") is None and not s.get("proposed"):
            continue
        text = f"{name} {s['steps_per_token']:.2f} steps/token" if s.get("steps_per_token") is not None else name
        if s.get("proposed"):
            text += (f", {s['accepted']:,}/{s['proposed']:,} drafts kept ({_pct(s['acceptance_rate'])}), acceptance "
                     f"length {s['mean_acceptance_length']:.2f}")
        parts.append(text)
    return "decode: " + "; ".join(parts) if parts else None


def server_clock_line(doc: dict) -> str | None:
    """The server's /metrics clock over the run (vLLM), beside the client's TTFT over the same requests."""
    clock = (doc.get("server") or {}).get("clock")
    if not clock:
        return None
    lanes = len(doc["lanes"])
    scope = "this run's only lane" if lanes == 1 else f"the run's {lanes} lanes together"
    parts = []
    for name in ("queue", "prefill", "decode", "ttft"):
        h = (clock.get("phases") or {}).get(name)
        if h and h.get("mean_s") is not None:
            tail = f" (p50 ≤ {_ms(h['p50_s'])}, p99 ≤ {_ms(h['p99_s'])})" if h.get("p99_s") is not None else ""
            mean = h["mean_s"] * 1e3
            parts.append(f"{name} mean {mean:,.3g} ms{tail}" if mean < 10 else f"{name} mean {mean:,.1f} ms{tail}")
    ttfts = [r["ttft_s"] for r in doc["requests"] if r["error"] is None and r["ttft_s"] is not None]
    client = f"; client TTFT mean {_ms(float(np.mean(ttfts)))} ms" if ttfts else ""
    hits = ""
    if clock.get("prefix_cache_queries"):
        hits = (f"; prefix cache served {_pct(clock['prefix_hit_rate'])} of {clock['prefix_cache_queries']:,.0f} prompt "
                f"tokens looked up")
    return (f"server clock ({clock['source']}, {scope}, {clock['requests']:,.0f} requests): "
            + ", ".join(parts) + client + hits)


def source_lines(doc: dict) -> list[str]:
    """Where each figure came from (the client's stream or the server's report), the workload's fitting to the
    server's context, and failures by class: the lines that say what the numbers are."""
    from twospeed.lab.fit import Fit

    run = doc["run"]
    lines = Fit.from_dict(run["fit"]).lines() if run.get("fit") else []
    if (line := server_clock_line(doc)) is not None:
        lines.append(line)
    sources = run.get("clock_sources") or {}
    if sources:
        lines.append("figures: " + "; ".join(f"{k} from {v}" for k, v in sources.items()))
    for name, lane in doc["lanes"].items():
        by = lane.get("errors_by_class") or {}
        if by:
            lines.append(f"errors in {name}: " + ", ".join(f"{v} {k}" for k, v in by.items()))
    return lines


def print_summary(doc: dict, console) -> None:
    from rich.table import Table

    run = doc["run"]
    title = (f"{run['workload']} against {run['model']} ({run['label'] or run['url']}), seed {run['seed']}, "
             f"{run['wall_s']:.1f} s, token timing from {run['token_source']}")
    table = Table(title=title)
    for h in HEADERS:
        table.add_column(h, justify="left" if h == "lane" else "right")
    for row in summary_rows(doc):
        table.add_row(*row)
    console.print(table)
    console.print(throughput_line(doc), highlight=False)
    for line in source_lines(doc):
        console.print(line, highlight=False, markup=False)
    if (line := spec_line(doc)) is not None:
        console.print(line, highlight=False)
    jobs = job_rows(doc)
    if jobs:
        jt = Table(title="jobs: wall time per job and the share of each part (queue/prefill/decode from the "
                         "server's clock where it gives one)")
        for h in JOB_HEADERS:
            jt.add_column(h, justify="left" if h == "job lane" else "right")
        for row in jobs:
            jt.add_row(*row)
        console.print(jt)
    c = doc["client"]
    if c["fell_behind"]:
        console.print(f"[bold yellow]warning[/]: the client fell behind its schedule: {c['late_requests']} requests "
                      f"sent more than {c['late_threshold_s'] * 1e3:.0f} ms late (max {_ms(c['lag_max_s'])} ms); "
                      "the load was lighter than intended")
    kv = doc["server"]["kv_memory"]
    if kv.get("cached_blocks") is not None:
        size = "" if kv["cached_kv_bytes"] is None else f" = {kv['cached_kv_bytes'] / 2**20:.1f} MiB of KV"
        console.print(f"KV held by cached prefixes at the end: {kv['cached_blocks']} blocks "
                      f"({kv['cached_tokens_held']:,} tokens){size}")
    for name, lane in doc["lanes"].items():
        for f in lane["gate"].get("failures", []):
            console.print(f"  gate failures in {name}: {f['count']} x {f['reason']}")
        fit = lane.get("prompt_fit") or {}
        if fit.get("off"):
            console.print(f"[bold yellow]note[/]: lane {name}: {fit['off']} of {fit['asked']} prompts billed other "
                          f"than asked (up to {fit['max_over']} over, {fit['max_under']} under): the lane asks for less "
                          "than its template takes, or the server's tokenizer is not --tokenizer")


# -- plots ------------------------------------------------------------------------------------------
def _plots(doc: dict, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = [r for r in doc["requests"] if r["error"] is None and r["ttft_s"] is not None]
    lanes = list(doc["lanes"])
    made = []

    def save(fig, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append((name, caption))

    fig, ax = plt.subplots(figsize=(6, 4))
    for lane in lanes:
        rs = [r for r in reqs if r["lane"] == lane]
        ax.scatter([r["prompt_tokens"] for r in rs], [r["ttft_s"] * 1e3 for r in rs], s=12, label=lane)
    ax.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="TTFT vs prompt length (prefill)")
    ax.legend(fontsize=8)
    save(fig, "ttft_vs_prompt.png", "Time to first token against prompt tokens, per lane.")

    fig, ax = plt.subplots(figsize=(6, 4))
    for lane in lanes:
        pos = [i + 1 for r in reqs if r["lane"] == lane for i in range(len(r["itl_s"]))]
        gaps = [g * 1e3 for r in reqs if r["lane"] == lane for g in r["itl_s"]]
        ax.scatter(pos, gaps, s=4, alpha=0.5, label=lane)
    ax.set(xlabel="output token position", ylabel="ITL (ms)", title="ITL vs token position (decode)")
    ax.legend(fontsize=8)
    save(fig, "itl_vs_position.png", "Each inter-token gap against the position of the token in its answer.")

    for metric, key, per_token in (("TTFT", "ttft_s", False), ("ITL", "itl_s", True)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for lane in lanes:
            rs = [r for r in reqs if r["lane"] == lane]
            v = np.sort([g for r in rs for g in r[key]] if per_token else [r[key] for r in rs]) * 1e3
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=lane)
        ax.set(xlabel=f"{metric} (ms)", ylabel="fraction", title=f"CDF of {metric} per lane")
        ax.legend(fontsize=8)
        save(fig, f"cdf_{metric.lower()}.png", f"Cumulative distribution of {metric} per lane.")

    timeline = doc["server"]["timeline"]
    if timeline:
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind in ("prefill", "decode"):
            pts = [(p["t_s"], p[f"{kind}_tokens_per_step"]) for p in timeline if p[f"{kind}_tokens_per_step"]]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=kind)
        ax.set(xlabel="time (s)", ylabel="tokens per step", title="Tokens per engine step (server)")
        ax.legend(fontsize=8)
        save(fig, "tokens_per_step.png", "Mean prefill and decode tokens per engine step, sampled from /metrics.")
    made += _job_plots(doc, out, plt)
    return made


def _job_plots(doc: dict, out: Path, plt) -> list[tuple[str, str]]:
    """Per job lane: a stacked bar of a job's mean time by part, and prompt growth and cache hit per turn."""
    lanes = {n: s["jobs"] for n, s in doc["lanes"].items() if s.get("jobs")}
    if not lanes:
        return []
    made = []
    fig, ax = plt.subplots(figsize=(7, 1.4 + 0.6 * len(lanes)))
    for i, (name, j) in enumerate(lanes.items()):
        left = 0.0
        for part in JOB_PARTS:
            width = j["split_s"][part] / max(1, j["jobs"])
            ax.barh(i, width, left=left, label=part if i == 0 else None)
            left += width
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set(xlabel="seconds per job (mean)", title="Where a job's time goes")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out / "job_split.png", dpi=90)
    plt.close(fig)
    made.append(("job_split.png", "A job's mean wall time per job lane, split into queue, prefill, decode, tool, "
                                  "gate and the rest."))
    for name, j in lanes.items():
        turns = j["turns"]
        x = [t["turn"] for t in turns]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(x, [t["cached_tokens"] for t in turns], label="cached")
        ax.bar(x, [t["prefilled_tokens"] for t in turns], bottom=[t["cached_tokens"] for t in turns], label="prefilled")
        ax.set(xlabel="turn", ylabel="prompt tokens (mean)", title=f"Prompt growth per turn: {name}", xticks=x)
        hit = ax.twinx()
        hit.plot(x, [(t["hit_rate"] or 0) * 100 for t in turns], color="black", marker="o", label="cache hit")
        hit.set(ylabel="cache hit (%)", ylim=(0, 100))
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        file = f"job_turns_{_slug(name)}.png"
        fig.savefig(out / file, dpi=90)
        plt.close(fig)
        made.append((file, f"{name}: mean prompt tokens per turn, cached vs prefilled, and the cache hit rate."))
    return made


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def write_html(doc: dict, out: Path) -> Path:
    """report.html (and dashboard.html, the server's dashboard views of the run, which it embeds)."""
    from twospeed.lab.report_dashboard import write_dashboard

    write_dashboard(doc, out)
    plots = _plots(doc, out)
    run = doc["run"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in summary_rows(doc))
    figs = "".join(f'<figure><img src="{n}" alt="{html.escape(c)}"><figcaption>{html.escape(c)}</figcaption></figure>'
                   for n, c in plots)
    jobs = job_rows(doc)
    job_table = ("<h2>Jobs</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in JOB_HEADERS) + "</tr>" +
                 "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in jobs) +
                 "</table>") if jobs else ""
    from twospeed.lab.diagnose import diagnose, diagnosis_lines

    spec = f"<p>{html.escape(line)}</p>" if (line := spec_line(doc)) is not None else ""
    sources = "".join(f"<p>{html.escape(line)}</p>" for line in source_lines(doc))
    diagnosis = "<h2>Diagnosis</h2><pre>" + html.escape("\n".join(diagnosis_lines(diagnose(doc)))) + "</pre>"
    c = doc["client"]
    warn = (f"<p class=warn>The client fell behind: {c['late_requests']} requests were sent late.</p>"
            if c["fell_behind"] else "")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>twospeed bench: {html.escape(run['workload'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:3px 6px;text-align:right}}pre{{white-space:pre-wrap;max-width:70em}}figure{{display:inline-block;margin:1em}}.warn{{color:#a60}}</style></head><body>
<h1>twospeed bench: {html.escape(run['workload'])}</h1>
<p>{html.escape(run['model'])} at {html.escape(run['url'])}{' (' + html.escape(run['label']) + ')' if run['label'] else ''};
seed {run['seed']}, started {html.escape(run['started_at'])}, {run['wall_s']:.1f} s; token timing from
{html.escape(run['token_source'])}; times in ms (TTFT: send to first content token; ITL: per token).</p>{warn}
<table><tr>{head}</tr>{body}</table><p>{html.escape(throughput_line(doc))}</p>{sources}{spec}{job_table}{figs}{diagnosis}
<h2>The dashboard's views of this run</h2><p><a href="dashboard.html">dashboard.html</a>: the server's /dashboard
panels (lanes, tokens per step, KV, the split bill, SLOs and miss causes, every request) for this run, offline.</p>
<iframe src="dashboard.html" title="dashboard" style="width:100%;height:1400px;border:1px solid #ccc"></iframe>
<p>Data: results.json (schema: twospeed/lab/results.schema.json), requests.csv, jobs.csv.</p></body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
