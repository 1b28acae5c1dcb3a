"""Served, side by side: twospeed against vLLM's CPU build (and llama.cpp up to 32 streams), one after another
in one sitting, with twospeed's in-process figure beside its served one.

    .venv/bin/python benchmarks/bench_served.py                      # appends a section to BENCHMARKS.md
    .venv/bin/python benchmarks/bench_served.py --quick --out /tmp/served.md
    .venv/bin/python benchmarks/bench_served.py --base /tmp/old-twospeed   # also serve another source tree

Prerequisites: the peers and their checkpoint (benchmarks/peers/README.md). Each engine is served with
benchmarks/peers/serve.py's settings over HTTP on loopback and measured with the same streaming client:
  b1      one request at a time: a 512-token prompt, 128 greedy tokens (EOS ignored): TTFT and decode tok/s
  c8/c32  N clients, 2 requests each (256 in, 128 out): output tok/s = output tokens / wall
  mixed   the lab's `mixed` workload (agent turns on a shared prefix, long RAG prompts, chat, nightly) through
          `twospeed bench` at two Poisson rates: per lane TTFT p50/p99, the chat lane's ITL p99 and max, out tok/s
twospeed in-process (LLM.generate, the same shapes, max_num_seqs = N so N run at once as over HTTP) is measured
in a subprocess after each served round, the server idle: served / in-process is the serving path's own cost
(on two cores that includes the benchmark client's share of them, the same for every engine).
--base serves a second twospeed from another source tree (before/after a change, same sitting). --rounds
repeats b1/c8/c32 for every engine in turn (this VM's speed drifts; the table shows each engine's median).
Never run it beside other work: two cores, every engine uses both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))

from client import PromptMaker  # noqa: E402
from run_peers import LoadMonitor, RunConfig, batch1, concurrent, lab_run, machine, salt, versions, warm_up  # noqa: E402
from serve import SETTINGS, WORK, command_for, launch, model_dir, free_port, served_name  # noqa: E402

INPROCESS = r"""
import json, random, sys, time
from twospeed import LLM, SamplingParams
model, levels, b1_prompt, b1_new, prompt, new = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:7])
rng = random.Random(0)
ids = lambda n: [rng.randrange(100, 30000) for _ in range(n)]
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
out = {}
llm = LLM(model, max_model_len=4096, kv_cache_memory_gb=2, max_num_seqs=32)
llm.generate([ids(64) for _ in range(4)], greedy(8))
o = llm.generate([ids(b1_prompt)], greedy(b1_new))[0]
out["b1"] = {"ttft_s": o.clock.ttft, "decode_tok_s": (len(o.token_ids) - 1) / (o.clock.ttlt - o.clock.ttft)}
for level in levels:
    llm.engine.scheduler.cfg.max_num_seqs = level
    t0 = time.perf_counter()
    outs = llm.generate([ids(prompt) for _ in range(2 * level)], greedy(new))
    out[str(level)] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def inprocess(source: Path, cfg: RunConfig) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": str(SETTINGS.threads), "PYTHONPATH": str(source)}
    args = [str(ROOT / ".venv/bin/python"), "-c", INPROCESS, str(model_dir("bf16")), json.dumps(cfg.conc_levels),
            str(cfg.b1_prompt), str(cfg.b1_new), str(cfg.conc_prompt), str(cfg.conc_new)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=source)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def mixed_summary(results: dict) -> dict:
    if "error" in results:
        return {"error": results["error"]}
    lanes = {name: {"ttft_p50": lane["stats"]["ttft"]["p50"], "ttft_p99": lane["stats"]["ttft"]["p99"],
                    "itl_p99": lane["stats"]["itl"]["p99"], "itl_max": lane["stats"]["itl"]["max"],
                    "errors": lane["errors"]} for name, lane in results["lanes"].items()}
    done = [r for r in results.get("requests", []) if r.get("error") is None]
    out_tokens = sum(r.get("output_tokens") or 0 for r in done)
    return {"lanes": lanes, "out_tok_s": out_tokens / results["run"]["wall_s"], "wall_s": results["run"]["wall_s"],
            "errors": results["total"]["errors"]}


def engine_runs(args) -> list[tuple[str, str, Path | None]]:
    """(label, engine, source tree for twospeed) in the order they are measured."""
    runs = []
    for engine in args.engines.split(","):
        if engine == "twospeed" and args.base:
            runs.append(("twospeed-base", "twospeed", Path(args.base).resolve()))
        runs.append((engine, engine, ROOT if engine == "twospeed" else None))
    return runs


def serve_label(label: str, engine: str, source: Path | None):
    port = free_port()
    cmd, env = command_for(engine, "bf16", port)
    if source is not None:  # that tree's twospeed, in the server and its engine process (run from there)
        env = env | {"PYTHONPATH": str(source)}
    return launch(engine, label, cmd, env, port, served_name("bf16"), cwd=source or ROOT)


def measure(label: str, engine: str, source: Path | None, cfg: RunConfig, args, scratch: Path, rounds: list) -> dict:
    tok = model_dir("bf16")
    result: dict = {"label": label, "engine": engine, "b1": [], "conc": {str(c): [] for c in cfg.conc_levels}}
    with serve_label(label, engine, source) as server:
        warm_up(server, PromptMaker(tok, salt(), cfg.seed))
        for _ in rounds:
            result["b1"].append(batch1(server, cfg, tok))
            for level in cfg.conc_levels:
                if engine == "llama" and level > 32:
                    continue
                result["conc"][str(level)].append(concurrent(server, cfg, tok, level)["output_tok_s"])
            print(f"  {label}: b1 {result['b1'][-1]['ttft_s'] * 1e3:.0f} ms / {result['b1'][-1]['decode_tok_s']:.1f}"
                  f" tok/s, " + ", ".join(f"c{c} {v[-1]:.0f}" for c, v in result["conc"].items() if v), flush=True)
            if source is not None:  # paired with the served round (this VM's speed drifts between minutes)
                result.setdefault("inprocess_rounds", []).append(inprocess(source, cfg))
                print(f"  {label} in-process: {result['inprocess_rounds'][-1]}", flush=True)
        if engine != "llama" and not args.no_mixed:
            result["mixed"] = {}
            for rate in args.rates:
                raw = lab_run(server, cfg, "mixed", args.mixed_requests, rate, scratch / f"{label}-mixed-{rate}", tok)
                result["mixed"][str(rate)] = mixed_summary(raw)
                print(f"  {label} mixed @ {rate}/s: {json.dumps(result['mixed'][str(rate)])[:400]}", flush=True)
    ok = [r for r in result.get("inprocess_rounds", []) if "error" not in r]
    if ok:
        result["inprocess"] = {"b1": {k: med([r["b1"][k] for r in ok]) for k in ("ttft_s", "decode_tok_s")},
                               **{str(c): med([r[str(c)] for r in ok]) for c in cfg.conc_levels}}
    return result


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def markdown(results: list[dict], cfg: RunConfig, args, meta: dict) -> str:
    f0 = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    f1 = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    vllm = next((r for r in results if r["engine"] == "vllm"), None)
    lines = [f"## Served, side by side (bench_served) — {meta['date']}", "",
             f"Command: `{meta['command']}` ({meta['wall_min']:.1f} min). Machine: {meta['machine']}. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}. Checkpoint: the peers' "
             f"~100M Llama, bf16. Medians of {args.rounds} round(s); other load while measuring: "
             f"{meta['load']:.2f} cores.", "",
             "| engine | b1 TTFT (ms) | b1 decode (tok/s) | " + " | ".join(f"c{c} out tok/s" for c in cfg.conc_levels)
             + " | × vLLM (c" + "/c".join(map(str, cfg.conc_levels)) + ") | served / in-process (b1 decode, "
             + ", ".join(f"c{c}" for c in cfg.conc_levels) + ") |",
             "|---|---:|---:|" + "---:|" * len(cfg.conc_levels) + "---|---|"]
    for r in results:
        ttft = med([b["ttft_s"] * 1e3 for b in r["b1"]])
        dec = med([b["decode_tok_s"] for b in r["b1"]])
        conc = [med(r["conc"][str(c)]) for c in cfg.conc_levels]
        vs = "-"
        if vllm is not None and r is not vllm:
            vs = " / ".join("-" if v is None or med(vllm["conc"][str(c)]) is None else
                            f"{v / med(vllm['conc'][str(c)]):.2f}" for v, c in zip(conc, cfg.conc_levels))
        ip = r.get("inprocess") or {}
        own = "-"
        if ip and "error" not in ip:
            own = " / ".join([f"{dec / ip['b1']['decode_tok_s']:.2f}" if dec else "-"]
                             + [f"{v / ip[str(c)]:.2f}" if v else "-" for v, c in zip(conc, cfg.conc_levels)])
        lines.append(f"| {r['label']} | {f0(ttft)} | {f1(dec)} | " + " | ".join(f0(v) for v in conc)
                     + f" | {vs} | {own} |")
        if ip and "error" not in ip:
            lines.append(f"| {r['label']} in-process | {f0(ip['b1']['ttft_s'] * 1e3)} | "
                         f"{f1(ip['b1']['decode_tok_s'])} | " + " | ".join(f0(ip[str(c)]) for c in cfg.conc_levels)
                         + " | | |")
    lines.append("")
    if any("mixed" in r for r in results):
        lanes = ("agent", "rag", "chat", "nightly")
        lines += [f"`mixed` ({args.mixed_requests} requests a rate, scale {cfg.lab_scale}, prompts capped at "
                  f"{cfg.lab_max_prompt_tokens} tokens, EOS ignored): TTFT p50 / p99 (s) per lane, the chat lane's "
                  "ITL p99 / max (s), output tok/s.", "",
                  "| engine | rate | " + " | ".join(f"{lane} TTFT" for lane in lanes)
                  + " | chat ITL p99 / max | out tok/s | errors |", "|---|---:|" + "---|" * len(lanes) + "---|---:|---:|"]
        for rate in args.rates:
            for r in results:
                s = r.get("mixed", {}).get(str(rate))
                if s is None:
                    continue
                if "error" in s:
                    lines.append(f"| {r['label']} | {rate} | failed: {s['error'][:100]} |")
                    continue
                cells = []
                for lane in lanes:
                    ln = s["lanes"].get(lane)
                    cells.append("-" if ln is None or ln["ttft_p50"] is None else
                                 f"{ln['ttft_p50']:.2f} / {ln['ttft_p99']:.2f}")
                chat = s["lanes"].get("chat") or {}
                itl = ("-" if chat.get("itl_p99") is None else f"{chat['itl_p99']:.3f} / {chat['itl_max']:.2f}")
                lines.append(f"| {r['label']} | {rate} | " + " | ".join(cells) + f" | {itl} | {s['out_tok_s']:.0f} | "
                             f"{s['errors']} |")
        lines.append("")
    lines += ["Settings (benchmarks/peers/serve.py): " + ", ".join(
        f"{k}={v}" for k, v in asdict(SETTINGS).items() if v not in ([], None)) + ".", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="twospeed,vllm,llama")
    ap.add_argument("--base", help="another twospeed source tree to serve first (its .venv: this one's)")
    ap.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[1.5, 3.0])
    ap.add_argument("--mixed-requests", type=int, default=90)
    ap.add_argument("--scale", type=float, default=0.35, help="the mixed workload's prompt scale (0.35: a 700-token "
                    "agent prefix, 1.4-2.8k-token RAG prompts)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes; writes only with --out")
    ap.add_argument("--out", help="markdown file to append to (default BENCHMARKS.md, not with --quick)")
    args = ap.parse_args()
    cfg = RunConfig(b1_repeats=3, conc_levels=(8, 32), conc_prompt=256, conc_new=128, conc_waves=2,
                    lab_scale=args.scale, lab_max_prompt_tokens=3600)
    if args.quick:
        cfg = RunConfig(b1_new=32, b1_repeats=1, conc_levels=(8, 32), conc_prompt=64, conc_new=16, conc_waves=1)
        args.mixed_requests, args.rates = 12, args.rates[:1]
    out = Path(args.out) if args.out else (None if args.quick else ROOT / "BENCHMARKS.md")
    scratch = WORK / "runs" / datetime.datetime.now(datetime.UTC).strftime("served-%Y%m%d-%H%M%S")
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = engine_runs(args)
    results = []
    with LoadMonitor() as monitor:
        mark = monitor.mark()
        for label, engine, source in runs:
            print(f"{label} ...", flush=True)
            try:
                results.append(measure(label, engine, source, cfg, args, scratch, list(range(args.rounds))))
            except Exception as e:  # one engine failing must not lose the others' numbers
                print(f"  {label} FAILED: {type(e).__name__}: {e}", flush=True)
        load = monitor.since(mark) or 0.0
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/bench_served.py " + " ".join(sys.argv[1:]),
            "wall_min": (time.monotonic() - t0) / 60, "machine": machine(), "versions": versions(), "load": load}
    text = markdown(results, cfg, args, meta).replace(str(ROOT) + "/", "")
    print(text)
    (scratch / "served.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    if out is not None:
        with open(out, "a") as f:
            f.write("\n" + text)
        print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
