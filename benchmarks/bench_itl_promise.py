"""The ITL promise under load: fixed step budgets against time-sized ones, and vLLM, on the same traffic.

Run on a quiet machine (about 30 minutes at the defaults):
    .venv/bin/python benchmarks/bench_itl_promise.py [--model PATH] [--rates 0.75,1.5,3]
        [--variants fixed-2048,fixed-256,time-50,time-50-strict,time-slo] [--engines twospeed,vllm] [--requests 40]
        [--json results.json] [--keep DIR]
    .venv/bin/python benchmarks/bench_itl_promise.py --smoke     # minutes: the demo model, tiny sizes, no vLLM

The model is the peers' ~100M Llama in bf16 (benchmarks/peers/make_checkpoint.py writes it under
benchmarks/peers/.work/models/llama100m-bf16) unless --model names another folder. Each twospeed variant is a
fresh `twospeed serve` with benchmarks/peers/serve.py's settings (2 threads, 32 sequences, 4096 tokens, 2 GiB of
KV) plus:
  fixed-2048   --target-step-ms 0: every step fills the 2048-token budget (the engine before time-sized steps)
  fixed-256    --max-num-batched-tokens 256 --target-step-ms 0: a small fixed budget
  time-50      the defaults: beside decodes, a step's predicted time stays within 50 ms (stretched to twice the
               decodes' own time where they alone take more than half of it: min_prompt_share 0.5); a waiting
               prompt that fits a step whole goes before a long one being chunked
  time-50-fcfs  the defaults with --short-prompts-first false: prompts admitted strictly in arrival order
  time-50-fixed-threads  the defaults with --adapt-threads false: the engine keeps its threads (no governor)
  time-50-thread  the defaults with --no-engine-process: the engine in a thread of the server's process, sharing
               its GIL with the HTTP side (how twospeed served before the engine got a process of its own)
  time-50-strict  --min-prompt-share 0: the 50 ms target strictly, one block a step where decodes fill it
  time-50-share-25  --min-prompt-share 0.25: where decodes alone take the target up, a step stretches to 1.33x
               their time (the default, 0.5, to 2x)
  time-slo     --slo for every lane of the workload (its ITL objectives x 0.8 size the steps while that lane
               decodes: chat 80 ms, agent 120 ms, rag 160 ms; nightly has none)
vLLM (serve.py's command, its own defaults) replays the same traffic in the same sitting. For each engine and
variant, at each rate, `twospeed bench --workload mixed` sends the same requests (same seed; a fresh salt, so no
run hits another's cache; --scale 0.3 puts the rag prompts at 1.2-2.4k tokens), and the report gives per lane
TTFT p50/p99, ITL p50/p99/max per token and per chunk, output tok/s, and for twospeed the cost model's
prediction error over the run's steps (from /metrics, scraped before and after: the share of steps predicted
within 10% and the interpolated p50/p99) and its step-time histogram's mixed steps. Then the issue's targets
are checked at the lowest rate where fixed 2048 stalls chat by > 1 s (else the middle one) and at twice it.
Nothing is written to BENCHMARKS.md; paste the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(ROOT))

from serve import SETTINGS, Server, free_port, serve, stop, wait_ready  # noqa: E402

from twospeed.engine.request import percentile  # noqa: E402
from twospeed.lab.workload import load_workload  # noqa: E402

DEFAULT_MODEL = HERE / "peers" / ".work" / "models" / "llama100m-bf16"
LANE_ORDER = ("chat", "agent", "nightly", "rag")


def slo_flags(workload: str) -> list[str]:
    """--slo flags carrying each lane's objectives from the workload's YAML."""
    flags = []
    for lane in load_workload(workload).lanes:
        s, items = lane.slo, []
        if s.ttft_ms:
            items.append(f"ttft_p99={s.ttft_ms:g}ms")
        if s.itl_ms:
            items.append(f"itl_p99={s.itl_ms:g}ms")
        if s.completion_window_s:
            items.append(f"ttlt={s.completion_window_s:g}s")
        if items:
            flags += ["--slo", f"{lane.name}:{','.join(items)}"]
    return flags


VARIANTS = {
    "fixed-2048": ["--target-step-ms", "0"],
    "fixed-256": ["--max-num-batched-tokens", "256", "--target-step-ms", "0"],
    "time-50": [],
    "time-50-fcfs": ["--short-prompts-first", "false"],  # the defaults, prompts admitted strictly in arrival order
    "time-50-fixed-threads": ["--adapt-threads", "false"],  # the defaults without the thread governor
    "time-50-thread": ["--no-engine-process"],  # the defaults with the engine in a thread of the server's process
    "time-50-strict": ["--min-prompt-share", "0"],
    "time-50-share-25": ["--min-prompt-share", "0.25"],  # a step stretches to 1.33x the decodes' time, not 2x
    "time-slo": ["@slo"],
}


@dataclass(slots=True)
class Plan:
    model: Path
    rates: list[float]
    requests: int
    variants: list[str]
    engines: list[str]
    scale: float
    max_prompt_tokens: int
    seed: int
    timeout_s: float
    threads: int


def twospeed_server(plan: Plan, variant: str, log: Path, flags: tuple[str, ...] = ()):
    """`twospeed serve` with the peers' settings and the variant's flags (then `flags`, which win over both);
    stopped (process group) on exit."""
    extra = [a for f in VARIANTS[variant] for a in (slo_flags("mixed") if f == "@slo" else [f])] + list(flags)
    return twospeed_serve(plan.model, extra, plan.threads, log)


@contextlib.contextmanager
def twospeed_serve(model: Path | str, flags: list[str], threads: int, log: Path):
    """`twospeed serve MODEL` (served as "bench") with serve.py's settings plus `flags`, on `threads` threads;
    stopped (process group) on exit."""
    port = free_port()
    s = SETTINGS
    cmd = [sys.executable, "-m", "twospeed.cli", "serve", "--model", str(model), "--served-model-name", "bench",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(s.max_num_seqs),
           "--max-model-len", str(s.max_model_len), "--kv-cache-memory-gb", str(s.kv_cache_gib),
           "--max-waiting", "1024", "--log-level", "warning", *flags]
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    server = Server("twospeed", "bf16", f"http://127.0.0.1:{port}", "bench", cmd, env, log)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        server.process = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, cwd=ROOT)
    try:
        wait_ready(server, s.startup_timeout_s)
        yield server
    finally:
        stop(server)


def scrape_buckets(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics samples by (name, labels); {} for a server without them."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def histogram_delta(before: dict, after: dict, name: str, **labels) -> list[tuple[float, float]]:
    """[(upper bound, count of observations <= it)] for the run (after - before), labels matched."""
    buckets: dict[float, float] = {}
    for (n, ls), v in after.items():
        d = dict(ls)
        if n != name + "_bucket" or any(d.get(k) != v2 for k, v2 in labels.items()):
            continue
        le = float(d["le"])
        buckets[le] = buckets.get(le, 0.0) + v - before.get((n, ls), 0.0)
    return sorted(buckets.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Linear interpolation inside the bucket holding rank q (Prometheus' histogram_quantile)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_n = q * buckets[-1][1], 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-12)
        prev_le, prev_n = le, n
    return prev_le


def cost_model_view(before: dict, after: dict) -> dict | None:
    err = histogram_delta(before, after, "twospeed_step_time_prediction_error")
    if not err:
        return None
    total = err[-1][1]
    within = next((n for le, n in err if le >= 0.1), 0.0)
    mixed = histogram_delta(before, after, "twospeed_step_time_seconds", kind="mixed")
    return {"steps": total, "within_10pct": within / total if total else None, "p50": quantile(err, 0.5),
            "p99": quantile(err, 0.99), "mixed_steps": mixed[-1][1] if mixed else 0,
            "mixed_step_p99_s": quantile(mixed, 0.99)}


def bench(plan: Plan, url: str, model_name: str, rate: float, out: Path, label: str) -> dict:
    """One `twospeed bench --workload mixed` run; its results.json, or {'error': ...}."""
    return run_bench(["--url", url + "/v1", "--model", model_name, "--workload", "mixed", "--requests",
                      str(plan.requests), "--rate", str(rate), "--seed", str(plan.seed), "--salt", secrets.token_hex(8),
                      "--tokenizer", str(plan.model), "--scale", str(plan.scale), "--max-prompt-tokens",
                      str(plan.max_prompt_tokens), "--ignore-eos", "--label", label, "--timeout", str(plan.timeout_s)],
                     out)


def run_bench(args: list[str], out: Path) -> dict:
    """`twospeed bench ARGS --out OUT --no-progress` (its log in OUT/bench.log); its results.json, or {'error': ...}."""
    cmd = [sys.executable, "-m", "twospeed.cli", "bench", *args, "--out", str(out), "--no-progress"]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=os.environ | {"PYTHONPATH": str(ROOT)}).returncode
    results = out / "results.json"
    if rc != 0 or not results.is_file():
        return {"error": f"twospeed bench exited {rc}; see {out / 'bench.log'}"}
    return json.loads(results.read_text())


def summarize(doc: dict) -> dict:
    """Per lane TTFT p50/p99, ITL p50/p99/max per token and per chunk; output tok/s; wall."""
    if "error" in doc:
        return doc
    lanes = {}
    for name, lane in doc["lanes"].items():
        st = lane["stats"]
        lanes[name] = {"ttft": (st["ttft"]["p50"], st["ttft"]["p99"]),
                       "itl": (st["itl"]["p50"], st["itl"]["p99"], st["itl"]["max"]),
                       "chunk": (st["chunk_gap"]["p50"], st["chunk_gap"]["p99"], st["chunk_gap"]["max"]),
                       "errors": lane["errors"]}
    tokens = {}
    for r in doc["requests"]:
        tokens[r["lane"]] = tokens.get(r["lane"], 0) + (r["output_tokens"] or 0)
    # Output tokens per lane: twospeed ends a structured answer when its schema completes, even with --ignore-eos,
    # where vLLM goes on to max_tokens; the agent lane then emits fewer tokens for the same answers, and out tok/s
    # is not the same work across engines (compare the lanes' TTFT, or out tok/s without the agent lane).
    return {"lanes": lanes, "output_tok_s": doc["total"]["throughput"]["output_tokens_per_s"],
            "output_tokens": tokens, "wall_s": doc["run"]["wall_s"], "errors": doc["total"]["errors"]}


def steps_profile(url: str, since: float) -> dict | None:
    """The run's engine steps from the server's own history (/dashboard/data): measured step time p50/p99/max,
    the share of steps that took over 1.5x their prediction, and of steps run on fewer threads than the most."""
    try:
        steps = httpx.get(f"{url}/dashboard/data", params={"since": since}, timeout=30).json()["steps"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    rows = [i for i in range(len(steps["t"])) if steps["num_prefill_tokens"][i] + steps["num_decode_tokens"][i] > 0]
    if not rows:
        return None
    times = sorted(steps["step_time"][i] for i in rows)
    slow = sum(1 for i in rows if (steps["predicted_time"][i] or 0) > 0
               and steps["step_time"][i] > 1.5 * steps["predicted_time"][i])
    most = max(steps["num_threads"][i] for i in rows)
    fewer = sum(1 for i in rows if steps["num_threads"][i] < most)
    return {"steps": len(rows), "p50": percentile(times, 50), "p99": percentile(times, 99), "max": times[-1],
            "slow_share": slow / len(rows),
            "fewer_threads_share": fewer / len(rows), "slowest": slowest_steps(steps, rows)}


def slowest_steps(steps: dict, rows: list[int], share: float = 0.02) -> dict:
    """What the slowest `share` of the steps were made of (medians): decode rows, prompt tokens, the target the
    prompt share was sized to and the prediction. A slow token waits on one of these steps; whether it was the
    decodes alone, a stretched target or a missed prediction says which lever bounds the ITL tail."""
    top = sorted(rows, key=lambda i: steps["step_time"][i])[-max(1, round(share * len(rows))):]

    def median(key: str) -> float | None:
        values = sorted(v for i in top if (v := steps[key][i]) is not None)
        return percentile(values, 50) if values else None

    return {"n": len(top), **{k: median(k) for k in ("step_time", "num_decode_tokens", "num_prefill_tokens",
                                                       "target_time", "predicted_time")}}


def measure(plan: Plan, scratch: Path) -> dict:
    runs: dict[str, dict[str, dict]] = {}
    configs = [("twospeed", v) for v in plan.variants] if "twospeed" in plan.engines else []
    configs += [("vllm", "defaults")] if "vllm" in plan.engines else []
    for engine, variant in configs:
        name = f"{engine}-{variant}" if engine != "twospeed" else variant
        runs[name] = {}
        log = scratch / f"{name}.log"
        started = time.monotonic()
        ctx = twospeed_server(plan, variant, log) if engine == "twospeed" else serve("vllm", "bf16")
        try:
            with ctx as server:
                print(f"{name}: ready in {time.monotonic() - started:.0f} s", flush=True)
                for rate in plan.rates:
                    before, since = scrape_buckets(server.url), time.time()
                    doc = bench(plan, server.url, server.model, rate, scratch / f"{name}-{rate}", name)
                    after = scrape_buckets(server.url)
                    s = summarize(doc)
                    if engine == "twospeed":
                        s["cost_model"] = cost_model_view(before, after)
                        s["steps"] = steps_profile(server.url, since)
                    runs[name][str(rate)] = s
                    print(f"  {name} @ {rate}/s: {json.dumps(s)[:400]}", flush=True)
        except (OSError, RuntimeError, TimeoutError) as e:
            runs[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {runs[name]['error']}", flush=True)
    return runs


# -- the report ------------------------------------------------------------------------------------------
def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.0f}"


def report(plan: Plan, runs: dict) -> str:
    lines = [f"`bench_itl_promise.py` — mixed workload, {plan.requests} requests a rate, scale {plan.scale}, "
             f"prompts capped at {plan.max_prompt_tokens}; model {plan.model.name}; seed {plan.seed}", ""]
    for rate in plan.rates:
        key = str(rate)
        lines += [f"### {rate} requests/s", "",
                  "Per lane: TTFT p50 / p99 · ITL per token p50 / p99 / max · per chunk p99 / max (ms)", "",
                  "| run | " + " | ".join(LANE_ORDER) + " | out tok/s | agent's output tokens | "
                  "cost model: within 10% / p50 / p99 |",
                  "|---|" + "---|" * len(LANE_ORDER) + "---:|---:|---|"]
        for name, by_rate in runs.items():
            s = by_rate.get(key) if "error" not in by_rate else by_rate
            if s is None:
                continue
            if "error" in s:
                lines.append(f"| {name} | {s['error']} |")
                continue
            cells = []
            for lane in LANE_ORDER:
                ln = s["lanes"].get(lane)
                cells.append("-" if ln is None else
                             f"{ms(ln['ttft'][0])} / {ms(ln['ttft'][1])} · {ms(ln['itl'][0])} / {ms(ln['itl'][1])} / "
                             f"{ms(ln['itl'][2])} · {ms(ln['chunk'][1])} / {ms(ln['chunk'][2])}")
            cm = s.get("cost_model")
            cost = "-" if not cm else (f"{cm['within_10pct']:.0%} / {cm['p50']:.3f} / {cm['p99']:.2f} "
                                       f"({cm['steps']:.0f} steps)")
            agent = s.get("output_tokens", {}).get("agent", "-")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {s['output_tok_s']:,.1f} | {agent} | {cost} |")
        lines.append("")
        lines += steps_table(runs, key)
    lines += targets(plan, runs)
    return "\n".join(lines)


def steps_table(runs: dict, key: str) -> list[str]:
    """twospeed's engine steps in each run (from the server's history): what a slow token was waiting on."""
    rows = [(name, by_rate[key]["steps"]) for name, by_rate in runs.items()
            if "error" not in by_rate and by_rate.get(key, {}).get("steps")]
    if not rows:
        return []
    lines = ["Engine steps (the server's history): measured step time p50 / p99 / max (ms), share over 1.5x the "
             "prediction, share on fewer threads; the slowest 2% of steps (medians): time, decode rows, prompt "
             "tokens, the target they were sized to, the prediction (ms)", "",
             "| run | steps | step time | > 1.5x predicted | fewer threads | slowest 2%: time / decodes / prompt / "
             "target / predicted |", "|---|---:|---|---:|---:|---|"]
    for name, st in rows:
        sl = st.get("slowest") or {}
        count = " / ".join("-" if sl.get(k) is None else f"{sl[k]:.0f}" for k in ("num_decode_tokens",
                                                                                  "num_prefill_tokens"))
        lines.append(f"| {name} | {st['steps']} | {ms(st['p50'])} / {ms(st['p99'])} / {ms(st['max'])} | "
                     f"{st['slow_share']:.1%} | {st['fewer_threads_share']:.1%} | {ms(sl.get('step_time'))} / "
                     f"{count} / {ms(sl.get('target_time'))} / {ms(sl.get('predicted_time'))} |")
    return lines + [""]


def _lane(runs: dict, name: str, rate: float, lane: str) -> dict | None:
    s = runs.get(name, {}).get(str(rate))
    return None if not s or "error" in s else s["lanes"].get(lane)


def targets(plan: Plan, runs: dict) -> list[str]:
    """The issue's targets for the defaults (time-50), at the lowest rate R where fixed 2048 stalls chat by > 1 s
    (the middle rate where none does) and at the run rate nearest 2R above it."""
    if "time-50" not in runs or "fixed-2048" not in runs or len(plan.rates) < 2:
        return []
    stalls = [x for x in plan.rates[:-1] if (c := _lane(runs, "fixed-2048", x, "chat")) and c["itl"][2] > 1.0]
    r = stalls[0] if stalls else plan.rates[len(plan.rates) // 2]
    r2 = min((x for x in plan.rates if x > r), key=lambda x: abs(x - 2 * r))
    out = ["### Targets (time-50, the defaults)", ""]

    def check(label: str, value: float | None, limit: float | None, fmt=ms) -> None:
        if value is None or limit is None:
            out.append(f"- {label}: not measured")
            return
        out.append(f"- {label}: {fmt(value)} against {fmt(limit)} — {'met' if value <= limit else 'MISSED'}")

    chat, chat2 = _lane(runs, "time-50", r, "chat"), _lane(runs, "time-50", r2, "chat")
    base_rag, rag = _lane(runs, "fixed-2048", r, "rag"), _lane(runs, "time-50", r, "rag")
    fixed_chat = _lane(runs, "fixed-2048", r, "chat")
    if fixed_chat:
        out.append(f"- at {r}/s fixed 2048's chat ITL max is {ms(fixed_chat['itl'][2])} ms (the rate should stall "
                   f"a stream by > 1 s)")
    check(f"{r}/s chat ITL max (ms)", chat and chat["itl"][2], 0.3)
    check(f"{r}/s chat ITL p99 (ms)", chat and chat["itl"][1], 0.1)
    tok, base_tok = (runs.get(n, {}).get(str(r), {}).get("output_tok_s") for n in ("time-50", "fixed-2048"))
    check(f"{r}/s output tok/s vs 0.95x fixed 2048 (inverted: lower is worse)", -tok if tok else None,
          -0.95 * base_tok if base_tok else None, fmt=lambda v: f"{-v:,.1f}")
    check(f"{r}/s rag TTFT p99 (ms) vs 1.5x fixed 2048", rag and rag["ttft"][1],
          base_rag and 1.5 * base_rag["ttft"][1])
    check(f"{r2}/s chat ITL p99 (ms)", chat2 and chat2["itl"][1], 0.15)
    check(f"{r2}/s chat ITL max (ms)", chat2 and chat2["itl"][2], 0.4)
    for lane in LANE_ORDER:
        ours, theirs = _lane(runs, "time-50", r2, lane), _lane(runs, "vllm-defaults", r2, lane)
        check(f"{r2}/s {lane} TTFT p99 (ms) vs vLLM", ours and ours["ttft"][1], theirs and theirs["ttft"][1])
    cms = [s.get("cost_model") for s in runs["time-50"].values() if isinstance(s, dict) and s.get("cost_model")]
    for cm in cms:
        out.append(f"- cost model median error {cm['p50']:.3f} (target <= 0.10; {cm['within_10pct']:.0%} of "
                   f"{cm['steps']:.0f} steps within 10%)")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="bf16 checkpoint folder (HF layout)")
    ap.add_argument("--rates", default="0.75,1.5,3", help="total requests/s, comma-separated")
    ap.add_argument("--requests", type=int, default=40, help="requests per rate")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"twospeed variants: {', '.join(VARIANTS)}")
    ap.add_argument("--engines", default="twospeed,vllm")
    ap.add_argument("--scale", type=float, default=0.3, help="prompt length scale (rag 4-8k -> 1.2-2.4k at 0.3)")
    ap.add_argument("--max-prompt-tokens", type=int, default=3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    ap.add_argument("--threads", type=int, default=SETTINGS.threads)
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--keep", type=Path, help="keep each run's results.json, logs and report.html here")
    ap.add_argument("--smoke", action="store_true", help="the demo model, 6 requests at one rate, twospeed only")
    args = ap.parse_args(argv)
    plan = Plan(args.model, [float(x) for x in args.rates.split(",")], args.requests, args.variants.split(","),
                args.engines.split(","), args.scale, args.max_prompt_tokens, args.seed, args.timeout, args.threads)
    if args.smoke:
        from twospeed.builtin.demo import demo_checkpoint_path
        plan.model, plan.rates, plan.requests, plan.engines = demo_checkpoint_path(), [2.0, 4.0], 6, ["twospeed"]
        plan.scale, plan.max_prompt_tokens, plan.timeout_s = 0.1, 1500, 120.0
    unknown = set(plan.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if not plan.model.is_dir():
        ap.error(f"{plan.model}: no checkpoint (benchmarks/peers/make_checkpoint.py writes it, or pass --model)")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        runs = measure(plan, scratch)
    text = report(plan, runs)
    print("\n" + text)
    if args.json:
        fields = {k: str(getattr(plan, k)) if isinstance(getattr(plan, k), Path) else getattr(plan, k)
                  for k in Plan.__dataclass_fields__}
        args.json.write_text(json.dumps({"plan": fields, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
