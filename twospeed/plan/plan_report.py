"""`twospeed plan`'s answers as tables: per replica, replicas, tuning, KV, formats, pools (from capacity.answer)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.3g}"


def _binding(point: dict | None) -> str:
    """'lane (cause: speed), attainment a < target t' for a point's binding lane."""
    if not point or not point.get("binding"):
        return "nothing binds"
    b = point["binding"]
    if b["cause"] == "backlog":
        q = point["verdict"]["backlog"]
        return (f"the queue grows (queue p90 {q['first_p90_s'] * 1e3:,.0f} ms in the first quarter of arrivals, "
                f"{q['last_p90_s'] * 1e3:,.0f} ms in the last; {b['lane']} waits longest) — short of {b['speed']}")
    return (f"{b['lane']} meets {b['attainment']:.1%} < {b['target']:.0%}, mostly {b['cause'] or '?'} — short of "
            f"{b['speed'] or '?'}")


def print_plan(report: dict, console: Console) -> None:
    dep = report["deployment"]
    what = (f"calibrated profile {dep.get('profile')} ({dep.get('key')})" if dep.get("cost_model") == "calibrated" else
            f"roofline on {dep.get('hardware_description')} ({dep.get('dtype')}, weights "
            f"{dep.get('quantization') or 'unquantized'}, KV {dep.get('kv_cache_dtype')}; efficiency "
            f"{dep['efficiency']['compute']:.0%} compute, {dep['efficiency']['bandwidth']:.0%} bandwidth, "
            f"{dep['efficiency']['step_overhead_s'] * 1e3:g} ms a step)")
    console.print(f"[bold]twospeed plan[/bold]: {what}")
    console.print("goals: " + "; ".join(f"{lane}: {', '.join(objs)}" for lane, objs in report["goals"].items() if objs))
    _per_replica(report["per_replica"], console)
    if report.get("replicas"):
        r = report["replicas"]
        console.print(f"\n[bold]replicas for {r['target_rate']:g} req/s[/bold]: "
                      + (f"{r['replicas']} (estimate {r['estimate']}, checked in the simulator behind a least-loaded "
                         f"router)" if r["replicas"] else
                         f"more than {r['checks'][-1]['replicas']} (none checked met)"))
    if report.get("tuning"):
        _tuning(report["tuning"], console)
    _kv(report["kv"], console)
    if report.get("formats"):
        _formats(report["formats"], console)
    for pool in report.get("pools") or []:
        _pools(pool, console)


def _per_replica(s: dict, console: Console) -> None:
    best, above = s["best"], s["above"]
    if best is None:
        console.print(f"\n[bold]max sustainable rate per replica[/bold]: none of the rates tried meets every goal "
                      f"(lowest {min(r for r, _ in s['tried']):.3g} req/s): {_binding(above)}")
        return
    tail = f"; at {above['rate']:.3g} req/s {_binding(above)}" if above else " (no rate tried failed)"
    console.print(f"\n[bold]max sustainable rate per replica: {best['rate']:.3g} req/s[/bold]{tail}")
    table = Table(show_edge=False, title="at the max rate, per lane (ms)")
    for col in ("lane", "requests", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "attainment"):
        table.add_column(col, justify="right")
    for lane, st in best["lanes"].items():
        v = best["verdict"]["lanes"].get(lane)
        table.add_row(lane, str(st["requests"]), _ms(st["ttft_p50"]), _ms(st["ttft_p99"]), _ms(st["itl_p50"]),
                      _ms(st["itl_p99"]), "-" if v is None else f"{v['attainment']:.1%} of {v['target']:.0%}")
    console.print(table)


def _tuning(t: dict, console: Console) -> None:
    table = Table(show_edge=False, title="step budget and step-time target (one replica)")
    for col in ("target_step_ms", "max_num_batched_tokens", "max rate", "binds above it"):
        table.add_column(col, justify="right")
    for r in t["rows"]:
        table.add_row(f"{r['target_step_ms']:g}" if r["target_step_ms"] else "off", str(r["max_num_batched_tokens"]),
                      _rate(r["max_rate"]), f"{r['binding'] or '-'} ({r['cause'] or '-'})")
    console.print()
    console.print(table)
    b = t["best"]
    console.print(f"best: --target-step-ms {b['target_step_ms']:g} --max-num-batched-tokens "
                  f"{b['max_num_batched_tokens']} ({_rate(b['max_rate'])} req/s)")


def _kv(kv: dict, console: Console) -> None:
    pool = kv.get("pool") or {}
    console.print(f"\n[bold]KV[/bold]: {pool.get('kv_capacity_tokens', 0):,} tokens in {pool.get('kv_blocks', 0):,} "
                  f"blocks of {pool.get('block_size')} ({pool.get('kv_pool_bytes', 0) / 1e9:.2f} GB, "
                  f"{pool.get('kv_bytes_per_token', 0):,} bytes a token); "
                  f"weights {pool.get('weight_bytes', 0) / 1e9:.2f} GB")
    for lane, p in kv["prefixes"].items():
        if p["prefix_tokens"]:
            console.print(f"  {lane}: its pinned prefix holds {p['cached_blocks']} blocks ({p['bytes'] / 1e6:,.1f} MB, "
                          f"{p['share_of_pool']:.2%} of the pool), reused by {p['reuse']:.0%} of its requests")
    at = kv.get("at_max_rate")
    if at:
        console.print(f"  at the max rate: at most {at['peak_kv_blocks']:,} blocks in use ({at['peak_share']:.1%} of "
                      f"the pool); {at['cached_blocks_at_end']:,} blocks cached at the end")


def _formats(rows: list[dict], console: Console) -> None:
    table = Table(show_edge=False, title="weight and KV formats (one replica)")
    for col in ("format", "max rate", "KV tokens", "weights GB", "binds above it"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["format"], _rate(r["max_rate"]), f"{r['kv_capacity_tokens']:,}",
                      f"{r['weight_bytes'] / 1e9:.2f}", f"{r['binding'] or '-'} ({r['cause'] or '-'})")
    console.print()
    console.print(table)


def _pools(pool: dict, console: Console) -> None:
    table = Table(show_edge=False, title=f"{pool['gpus']} replicas: colocated vs prefill + decode pools")
    for col in ("layout", "max rate", "per replica", "binds above it"):
        table.add_column(col, justify="right")
    for r in pool["rows"]:
        name = "colocated" if r["prefill"] is None else f"{r['prefill']}P + {r['decode']}D"
        table.add_row(name, _rate(r["max_rate"]), _rate(r["per_gpu"]), f"{r['binding'] or '-'} ({r['cause'] or '-'})")
    console.print()
    console.print(table)
    b = pool["best"]
    layout = "colocated" if b["prefill"] is None else f"{b['prefill']} prefill + {b['decode']} decode"
    console.print(f"best for {pool['gpus']}: {layout} ({_rate(b['max_rate'])} req/s)")
