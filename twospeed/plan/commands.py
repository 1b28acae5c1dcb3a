"""`twospeed clock`: the toy two-clocks model, or with --model and --hardware the roofline.

The toy path only touches plan/clock.py (standard library). The roofline path reads the
model's config.json, takes a hardware profile (or measures this machine) and prints, per
case, prefill FLOPs / peak FLOP/s and decode bytes / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys

from twospeed.plan.clock import DEFAULT_CASES, add_toy_args, parse_case, run_toy


def add_clock_args(parser: argparse.ArgumentParser) -> None:
    add_toy_args(parser)
    parser.add_argument("--model", help="roofline: a checkpoint folder, its config.json, or 'demo'")
    parser.add_argument("--hardware", help="roofline: a built-in profile (see --list-hardware) or 'local' (measured now)")
    parser.add_argument("--list-hardware", action="store_true", help="print the built-in hardware profiles and exit")
    parser.add_argument("--batch", type=int, default=1, help="roofline: sequences decoding together (default 1)")
    parser.add_argument("--dtype", help="roofline: weight and KV dtype (default: the checkpoint's)")
    parser.add_argument("--device", help="roofline, --hardware local: torch device to probe (default cuda if present)")
    parser.add_argument("--probe-seconds", type=float, default=1.5, help="roofline, --hardware local: probe time")


def run_clock(args: argparse.Namespace) -> int:
    if args.list_hardware:
        return _list_hardware(args)
    if args.model is None and args.hardware is None:
        return run_toy(args)
    if args.model is None or args.hardware is None:
        print("twospeed clock: the roofline needs both --model and --hardware", file=sys.stderr)
        return 2
    return _run_roofline(args)


def _list_hardware(args: argparse.Namespace) -> int:
    from twospeed.plan.hardware import PROFILES

    rows = [{"name": p.name, "description": p.description,
             "peak_tflops": {k: v / 1e12 for k, v in p.peak_flops.items()},
             "bandwidth_gb_s": p.memory_bandwidth / 1e9, "source": p.source} for p in PROFILES.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            flops = ", ".join(f"{k} {v:g} TFLOP/s" for k, v in r["peak_tflops"].items())
            print(f"{r['name']:14} {r['description']}: {flops}; {r['bandwidth_gb_s']:g} GB/s  [{r['source']}]")
    return 0


def _run_roofline(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from twospeed.plan.hardware import get_profile
    from twospeed.plan.roofline import dtype_bytes, dtype_name, load_config, roofline_case

    try:
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        shapes = [parse_case(c) for c in args.cases] or list(DEFAULT_CASES)
        cfg = load_config(args.model)
        dtype = args.dtype or dtype_name(cfg.dtype)
        nbytes = dtype_bytes(dtype)
        hw = get_profile(args.hardware, device=args.device, probe_seconds=args.probe_seconds)
        peak = hw.flops_for(dtype)
        cases = [roofline_case(cfg, peak, hw.memory_bandwidth, p, o, args.batch, nbytes) for p, o in shapes]
    except (ValueError, OSError) as e:
        print(f"twospeed clock: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "architecture": cfg.architecture, "dtype": dtype,
                          "hardware": {"name": hw.name, "description": hw.description, "peak_flops": peak,
                                       "memory_bandwidth": hw.memory_bandwidth},
                          "cases": [c.to_dict() for c in cases]}, indent=2))
        return 0
    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)  # a log file or a pipe: keep each case on one line
    console.print(f"roofline: {args.model} ({cfg.architecture}, {dtype}) on {hw.description}: "
                  f"{peak / 1e12:.3g} TFLOP/s {dtype}, {hw.memory_bandwidth / 1e9:.4g} GB/s; "
                  f"KV {cases[0].kv_bytes_per_token:,} bytes/token; decode batch {args.batch}")
    table = Table(show_edge=False)
    for col in ("prompt", "output", "prefill GFLOP", "prefill ≥", "decode step MB (first→last)", "decode ≥",
                "ITL ≥", "KV held MB"):
        table.add_column(col, justify="right")
    for c in cases:
        table.add_row(f"{c.prompt_tokens:,}", f"{c.output_tokens:,}", f"{c.prefill_flops / 1e9:,.1f}",
                      _seconds(c.prefill_s), f"{c.decode_bytes_first / 1e6:,.1f}→{c.decode_bytes_last / 1e6:,.1f}",
                      _seconds(c.decode_s), _seconds(c.itl_s), f"{c.kv_bytes / 1e6:,.1f}")
    console.print(table)
    console.print("floors: prefill = FLOPs / peak, decode = bytes / bandwidth (weights + KV read per step)")
    return 0


def _seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"
