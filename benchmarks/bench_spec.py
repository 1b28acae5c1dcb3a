"""Speculative decoding on templated and open traffic: ngram and draft, with and without fallback, and vLLM's ngram.

Run on a quiet machine (about 40 minutes at the defaults):
    .venv/bin/python benchmarks/bench_spec.py [--model demo-task] [--draft-model demo-task-draft]
        [--workloads tasks] [--lanes agent,chat] [--configs none,ngram,ngram-nofb,draft,draft-nofb,vllm-none,vllm-ngram]
        [--requests 40] [--rate 1.0] [--gamma 4] [--json results.json] [--keep DIR]
    .venv/bin/python benchmarks/bench_spec.py --smoke     # minutes: the demo model, tiny sizes, no vLLM

The model is the built-in task model `demo-task` (trained on the lab's lane formats, so a tool call's JSON
follows its schema and examples, and acceptance means something) with its draft `demo-task-draft` (not built
in yet: the draft configs need --draft-model FOLDER on it), and the lab's `tasks` workload (its prompts drawn
from the same formats). `--model demo` runs the random demo with `demo-draft` on the lab's `agent` and `chat`
workloads: the harness runs end to end, but acceptance on random weights says nothing about real traffic. Each config is a fresh server on the same traffic (same seed, a fresh salt so no run
hits another's cache), with benchmarks/peers/serve.py's settings (2 threads, 32 sequences, 2 GiB of KV):
  none         no speculation
  ngram        --spec-method ngram (prompt lookup), auto-fallback on (the default)
  ngram-nofb   the same, --spec-auto-fallback false: always num_speculative_tokens drafts
  draft        --spec-method draft --draft-model DRAFT, auto-fallback on
  draft-nofb   the same without fallback
  vllm-none    vLLM (serve.py's command), no speculation
  vllm-ngram   vLLM with --speculative-config {"method": "ngram", ...}, the same gamma and n-gram window
Per lane it reports decode steps per output token (the server's decode steps + 1 over its output tokens; for
vLLM the streamed chunks that carried tokens, one per engine step), ITL p50/p99 per token, TPOT p50, output
tok/s, and for twospeed drafts kept of verified and the mean acceptance length, then checks the issue's
targets. Nothing is written to BENCHMARKS.md; paste the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(ROOT))

from bench_itl_promise import run_bench, twospeed_serve  # noqa: E402
from serve import SETTINGS, serve  # noqa: E402

TWOSPEED_FLAGS = {
    "none": [],
    "ngram": ["--spec-method", "ngram"],
    "ngram-nofb": ["--spec-method", "ngram", "--spec-auto-fallback", "false"],
    "draft": ["--spec-method", "draft", "--draft-model", "@draft"],
    "draft-nofb": ["--spec-method", "draft", "--draft-model", "@draft", "--spec-auto-fallback", "false"],
}
VLLM_CONFIGS = ("vllm-none", "vllm-ngram")
CONFIGS = (*TWOSPEED_FLAGS, *VLLM_CONFIGS)


@dataclass(slots=True)
class Plan:
    model: str  # a built-in name or a checkpoint folder
    draft_model: str
    workloads: list[str]
    lanes: list[str]
    configs: list[str]
    requests: int
    rate: float
    gamma: int
    lookup_min: int
    lookup_max: int
    scale: float
    max_prompt_tokens: int
    seed: int
    timeout_s: float
    threads: int


def builtin_folder(name: str) -> Path:
    """A built-in model's checkpoint folder (built on first use), or the folder given."""
    from twospeed.builtin.registry import builtin_checkpoint_path, is_builtin

    return builtin_checkpoint_path(name) if is_builtin(name) else Path(name)


def twospeed_server(plan: Plan, config: str, model: Path, log: Path):
    """`twospeed serve` with the peers' settings and the config's speculation flags; stopped on exit."""
    flags = [str(builtin_folder(plan.draft_model)) if f == "@draft" else f for f in TWOSPEED_FLAGS[config]]
    if config != "none":
        flags += ["--num-speculative-tokens", str(plan.gamma), "--prompt-lookup-min", str(plan.lookup_min),
                  "--prompt-lookup-max", str(plan.lookup_max)]
    return twospeed_serve(model, flags, plan.threads, log)


def vllm_server(plan: Plan, config: str, model: Path):
    spec = []
    if config == "vllm-ngram":
        spec = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": plan.gamma,
                                                    "prompt_lookup_min": plan.lookup_min,
                                                    "prompt_lookup_max": plan.lookup_max})]
    # vLLM refuses a max_model_len past the checkpoint's positions (the task model has 2048, the peers' 4096)
    positions = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    settings = dataclasses.replace(SETTINGS, vllm_args=[*SETTINGS.vllm_args, *spec],
                                   max_model_len=min(SETTINGS.max_model_len, positions or SETTINGS.max_model_len))
    return serve("vllm", "bf16", settings, model=model)  # its log: .work/logs/vllm-bf16.log


def bench(plan: Plan, url: str, model_name: str, workload: str, tokenizer: Path, out: Path, label: str) -> dict:
    """One `twospeed bench` run of a workload; its results.json, or {'error': ...}."""
    return run_bench(["--url", url + "/v1", "--model", model_name, "--workload", workload, "--requests",
                      str(plan.requests), "--rate", str(plan.rate), "--seed", str(plan.seed), "--salt",
                      secrets.token_hex(8), "--tokenizer", str(tokenizer), "--scale", str(plan.scale),
                      "--max-prompt-tokens", str(plan.max_prompt_tokens), "--label", label, "--timeout",
                      str(plan.timeout_s)], out)


def lane_numbers(lane: dict) -> dict:
    st, spec = lane["stats"], lane.get("spec") or {}
    return {"steps_per_token": spec.get("steps_per_token"), "itl_p50": st["itl"]["p50"], "itl_p99": st["itl"]["p99"],
            "tpot_p50": st["tpot"]["p50"], "output_tok_s": lane["throughput"]["output_tokens_per_s"],
            "proposed": spec.get("proposed"), "accepted": spec.get("accepted"),
            "acceptance_length": spec.get("mean_acceptance_length"), "errors": lane["errors"]}


def measure(plan: Plan, scratch: Path) -> dict:
    """{config: {lane: numbers}} over every workload (a lane name once), or {config: {'error': ...}}."""
    model = builtin_folder(plan.model)
    runs: dict[str, dict] = {}
    for config in plan.configs:
        log, started = scratch / f"{config}.log", time.monotonic()
        ctx = (twospeed_server(plan, config, model, log) if config in TWOSPEED_FLAGS
               else vllm_server(plan, config, model))
        runs[config] = {}
        try:
            with ctx as server:
                print(f"{config}: ready in {time.monotonic() - started:.0f} s", flush=True)
                for workload in plan.workloads:
                    doc = bench(plan, server.url, server.model, workload, model, scratch / f"{config}-{workload}",
                                config)
                    if "error" in doc:
                        runs[config][f"@{workload}"] = doc
                        print(f"  {config} {workload}: {doc['error']}", flush=True)
                        continue
                    for name, lane in doc["lanes"].items():
                        if name in plan.lanes and name not in runs[config]:
                            runs[config][name] = lane_numbers(lane)
                    print(f"  {config} {workload}: {json.dumps(runs[config])[:400]}", flush=True)
        except (OSError, RuntimeError, TimeoutError) as e:
            runs[config] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{config}: {runs[config]['error']}", flush=True)
    return runs


# -- the report ------------------------------------------------------------------------------------------
def _f(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def report(plan: Plan, runs: dict) -> str:
    lines = [f"`bench_spec.py` — model {plan.model} (draft {plan.draft_model}), workloads {', '.join(plan.workloads)}, "
             f"{plan.requests} requests at {plan.rate}/s each; gamma {plan.gamma}, n-gram "
             f"{plan.lookup_min}-{plan.lookup_max}; seed {plan.seed}", ""]
    for lane in plan.lanes:
        lines += [f"### {lane} lane", "",
                  "| config | steps/token | ITL p50 / p99 (ms) | TPOT p50 (ms) | out tok/s | kept/verified | "
                  "acceptance length |", "|---|---:|---:|---:|---:|---:|---:|"]
        for config, by_lane in runs.items():
            if "error" in by_lane:
                lines.append(f"| {config} | {by_lane['error']} |")
                continue
            n = by_lane.get(lane)
            if n is None:
                continue
            kept = f"{n['accepted']:,}/{n['proposed']:,}" if n["proposed"] else "-"
            lines.append(f"| {config} | {_f(n['steps_per_token'], '.3f')} | {_f(n['itl_p50'], ',.1f', 1e3)} / "
                         f"{_f(n['itl_p99'], ',.1f', 1e3)} | {_f(n['tpot_p50'], ',.1f', 1e3)} | "
                         f"{_f(n['output_tok_s'], ',.1f')} | {kept} | {_f(n['acceptance_length'], '.2f')} |")
        lines.append("")
    return "\n".join(lines + targets(runs))


def _get(runs: dict, config: str, lane: str, key: str) -> float | None:
    n = runs.get(config, {}).get(lane)
    return None if not isinstance(n, dict) else n.get(key)


def targets(runs: dict) -> list[str]:
    """The issue's targets: agent >= 1.8x fewer steps per token and >= 1.5x lower TPOT with speculation; chat with
    fallback TPOT within 5% of none (and without fallback, shown); twospeed's agent ngram TPOT <= vLLM's."""
    out = ["### Targets", ""]

    def check(label: str, value: float | None, limit: float | None, higher_is_better: bool) -> None:
        if value is None or limit is None:
            out.append(f"- {label}: not measured")
            return
        met = value >= limit if higher_is_better else value <= limit
        out.append(f"- {label}: {value:.3f} against {limit:.3f} — {'met' if met else 'MISSED'}")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    base_steps, base_tpot = _get(runs, "none", "agent", "steps_per_token"), _get(runs, "none", "agent", "tpot_p50")
    for method in ("ngram", "draft"):
        check(f"agent steps/token, none / {method}", ratio(base_steps, _get(runs, method, "agent", "steps_per_token")),
              1.8, True)
        check(f"agent TPOT p50, none / {method}", ratio(base_tpot, _get(runs, method, "agent", "tpot_p50")), 1.5, True)
    chat = _get(runs, "none", "chat", "tpot_p50")
    for config in ("ngram", "draft"):
        check(f"chat TPOT p50, {config} (fallback on) / none", ratio(_get(runs, config, "chat", "tpot_p50"), chat),
              1.05, False)
        nofb = ratio(_get(runs, f"{config}-nofb", "chat", "tpot_p50"), chat)
        out.append(f"- chat TPOT p50, {config}-nofb / none (may be worse; shown): {_f(nofb, '.3f')}")
    check("agent TPOT p50 (ms), twospeed ngram vs vLLM ngram", _get(runs, "ngram", "agent", "tpot_p50"),
          _get(runs, "vllm-ngram", "agent", "tpot_p50"), False)
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-task", help="built-in name or checkpoint folder (HF layout)")
    ap.add_argument("--draft-model", help="the draft (default: demo-task-draft for demo-task, demo-draft for demo)")
    ap.add_argument("--workloads", help="lab workloads, comma-separated (default: tasks; agent,chat on demo)")
    ap.add_argument("--lanes", default="agent,chat", help="lanes reported, comma-separated")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"from {', '.join(CONFIGS)}")
    ap.add_argument("--requests", type=int, default=40, help="requests per workload run")
    ap.add_argument("--rate", type=float, default=1.0, help="total requests/s")
    ap.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens (twospeed and vLLM)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--scale", type=float, default=1.0, help="the lab's prompt length scale")
    ap.add_argument("--max-prompt-tokens", type=int, default=3600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    ap.add_argument("--threads", type=int, default=SETTINGS.threads)
    ap.add_argument("--json", type=Path, help="also write every number here")
    ap.add_argument("--keep", type=Path, help="keep each run's results.json, logs and report.html here")
    ap.add_argument("--smoke", action="store_true", help="the demo model, 3 requests a workload, twospeed only")
    args = ap.parse_args(argv)
    model = "demo" if args.smoke else args.model
    task = model.startswith("demo-task")
    draft = args.draft_model or ("demo-task-draft" if task else "demo-draft")
    workloads = args.workloads or ("tasks" if task else "agent,chat")
    plan = Plan(model, draft, workloads.split(","), args.lanes.split(","), args.configs.split(","), args.requests,
                args.rate, args.gamma, args.prompt_lookup_min, args.prompt_lookup_max, args.scale,
                args.max_prompt_tokens, args.seed, args.timeout, args.threads)
    if args.smoke:
        plan.configs = [c for c in plan.configs if c in TWOSPEED_FLAGS]
        plan.requests, plan.rate, plan.scale, plan.max_prompt_tokens, plan.timeout_s = 3, 4.0, 0.1, 1500, 120.0
    unknown = set(plan.configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its server (finally)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        runs = measure(plan, scratch)
    text = report(plan, runs)
    print("\n" + text)
    if args.json:
        args.json.write_text(json.dumps({"plan": dataclasses.asdict(plan), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
