"""twospeed against vLLM (CPU build) and llama.cpp (llama-server), side by side on the same checkpoint.

    .venv/bin/python benchmarks/peers/run_peers.py                 # full run: appends to BENCHMARKS.md
    .venv/bin/python benchmarks/peers/run_peers.py --quick --out /tmp/peers.md   # smoke run, a few minutes

Prerequisites: `bash benchmarks/peers/setup.sh` (peers) and
`benchmarks/peers/.work/venv-convert/bin/python benchmarks/peers/make_checkpoint.py` (the checkpoint).

Each engine in turn is started on loopback (serve.py: settings in one place), warmed up, measured, stopped;
only one runs at a time. Measured, each also as a ratio to the best engine in the same run (1.00 = best;
for latencies the ratio is best / value, so below 1 is slower for every column):
  (1) batch 1: TTFT of a 512-token prompt and decode tok/s over 128 greedy tokens (EOS ignored); median of
      --repeats requests, one at a time (client.py's streaming client);
  (2) 8 and 32 concurrent requests (closed loop, 2 waves; prompt 256 tokens, 128 output tokens each):
      total output tok/s = output tokens / wall;
  (3) the lab's `mixed` workload at increasing total rates (`--rate`) through `twospeed bench`: per lane TTFT p99,
      ITL p99 and SLO attainment; SLO goodput (requests meeting their lane's SLO per second); the highest
      rate at which every lane meets its SLO. The checkpoint has random weights, so the lab's output gates
      (JSON, citations) fail for every engine alike and its gated goodput is not shown;
  (4) the `agent` workload: TTFT p50/p99 when the shared prefix is warm (the lab's own salt keeps earlier
      runs' caches out; its prefix reuse within the run is the point).
Every run salts its prompts (a fresh salt per engine and measurement), so no prefix cache helps (1)-(2).
A thread samples the load other processes put on the machine; the table reports it, since with two threads
on two cores any other load distorts every engine's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from client import PromptMaker, Timing, request_body, run_concurrent  # noqa: E402
from serve import ENGINES, SETTINGS, WORK, Server, model_dir, serve  # noqa: E402

TWOSPEED = ROOT / ".venv/bin/twospeed"


@dataclass(slots=True)
class RunConfig:
    """What one run measures; --quick shrinks it."""

    engines: tuple[str, ...] = ENGINES
    dtypes: tuple[str, ...] = ("bf16",)
    seed: int = 0
    b1_prompt: int = 512
    b1_new: int = 128
    b1_repeats: int = 3
    conc_levels: tuple[int, ...] = (8, 32)
    conc_prompt: int = 256
    conc_new: int = 128
    conc_waves: int = 2
    mixed_rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)  # requests/s over all lanes (the workload's own: 2.0)
    mixed_requests: int = 24
    agent_requests: int = 16
    agent_rate: float = 0.5
    lab_scale: float = 0.5  # the mixed workload's rag prompts (4-8k tokens) must fit the 4096-token model
    lab_max_prompt_tokens: int = 3600
    lab_timeout_s: float = 120.0  # a request still unanswered then is an error (and far past every SLO)
    saturation_factor: float = 2.0  # a mixed run longer than this x its arrival span stops the rate ladder


QUICK = dict(b1_prompt=512, b1_new=32, b1_repeats=1, conc_levels=(8, 32), conc_prompt=64, conc_new=16,
             conc_waves=1, mixed_rates=(1.0, 2.0), mixed_requests=12, agent_requests=6, agent_rate=1.0)


class LoadMonitor:
    """Average cores kept busy by other processes (machine busy time minus this process and its children,
    the servers' included), sampled in a thread."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._ours: set[int] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._hz = os.sysconf("SC_CLK_TCK")

    def _busy(self) -> float:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / self._hz

    def _ours_cpu(self) -> float:
        """CPU seconds of this process and every descendant (servers, their workers), with what each one's ended
        children used (cutime, cstime): a `twospeed bench` run that exited is not another process's load."""
        total, children = 0.0, {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                    parts = stat[stat.rindex(")") + 2:].split()
                    children.setdefault(int(parts[1]), []).append((int(d.name), sum(map(int, parts[11:15]))))
                except (OSError, ValueError):
                    continue
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        total = sum(map(int, own[11:15]))
        stack = [os.getpid()]
        while stack:
            for pid, ticks in children.get(stack.pop(), []):
                self._ours.add(pid)
                total += ticks
                stack.append(pid)
        return total / self._hz

    def _run(self) -> None:
        busy, ours = self._busy(), self._ours_cpu()
        while not self._stop.wait(2.0):
            b, o = self._busy(), self._ours_cpu()
            self.samples.append(max(0.0, (b - busy) - (o - ours)) / 2.0)
            busy, ours = b, o

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> int:
        return len(self.samples)

    def since(self, mark: int) -> float | None:
        s = self.samples[mark:]
        return statistics.fmean(s) if s else None


# -- (1) and (2): our own client -----------------------------------------------------------------------
def salt() -> str:
    return secrets.token_hex(4)


def warm_up(server: Server, prompts: PromptMaker) -> None:
    """Two short requests and a full-length one, not timed: first-call compilation and allocation."""
    bodies = [request_body(server.model, prompts.make(32, i), 8) for i in range(2)]
    bodies.append(request_body(server.model, prompts.make(512, 2), 8))
    asyncio.run(run_concurrent(server.url, bodies, 1))
    asyncio.run(run_concurrent(server.url, [request_body(server.model, prompts.make(64, 3 + i), 8)
                                            for i in range(8)], 8))


def batch1(server: Server, cfg: RunConfig, tokenizer_dir: Path) -> dict:
    prompts = PromptMaker(tokenizer_dir, salt(), cfg.seed)
    timings: list[Timing] = []
    for i in range(cfg.b1_repeats):
        body = request_body(server.model, prompts.make(cfg.b1_prompt, i), cfg.b1_new)
        timings += asyncio.run(run_concurrent(server.url, [body], 1))[0]
    return {"ttft_s": statistics.median(t.ttft_s for t in timings),
            "decode_tok_s": statistics.median(t.decode_tok_s for t in timings),
            "ttfts_s": [round(t.ttft_s, 4) for t in timings],
            "output_tokens": [t.output_tokens for t in timings]}


def concurrent(server: Server, cfg: RunConfig, tokenizer_dir: Path, level: int) -> dict:
    prompts = PromptMaker(tokenizer_dir, salt(), cfg.seed + level)
    bodies = [request_body(server.model, prompts.make(cfg.conc_prompt, i), cfg.conc_new)
              for i in range(level * cfg.conc_waves)]
    errors: list[str] = []
    timings, wall = asyncio.run(run_concurrent(server.url, bodies, level, errors))
    if len(errors) * 4 > len(bodies):
        raise RuntimeError(f"{len(errors)} of {len(bodies)} requests failed, e.g. {errors[0]}")
    out = sum(t.output_tokens for t in timings)
    # a failed request's tokens are not counted, its time is: the rate stays a lower bound
    return {"requests": len(bodies), "output_tokens": out, "wall_s": wall, "output_tok_s": out / wall,
            "ttft_p50_s": statistics.median(t.ttft_s for t in timings), "errors": errors}


# -- (3) and (4): the lab --------------------------------------------------------------------------------
def lab_available() -> bool:
    try:
        return subprocess.run([str(TWOSPEED), "bench", "--help"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def lab_run(server: Server, cfg: RunConfig, workload: str, requests: int, rate: float, out_dir: Path,
            tokenizer_dir: Path) -> dict:
    """One `twospeed bench` run; returns its results.json (or {'error': ...})."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(TWOSPEED), "bench", "--url", server.url + "/v1", "--model", server.model, "--workload", workload,
           "--requests", str(requests), "--rate", str(rate), "--seed", str(cfg.seed), "--out", str(out_dir),
           "--tokenizer", str(tokenizer_dir), "--scale", str(cfg.lab_scale),
           "--max-prompt-tokens", str(cfg.lab_max_prompt_tokens), "--ignore-eos", "--no-progress",
           "--label", f"{server.engine}-{server.dtype}", "--timeout", str(cfg.lab_timeout_s)]
    with open(out_dir / "bench.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    results = out_dir / "results.json"
    if rc != 0 or not results.is_file():
        return {"error": f"twospeed bench exited {rc}; see {out_dir / 'bench.log'}", "command": cmd}
    data = json.loads(results.read_text())
    data["command"] = cmd
    return data


def saturated(summary: dict, arrival_span_s: float, factor: float) -> bool:
    """The server fell behind: the run took `factor` times its arrivals' span (or failed). A higher rate would
    only queue longer, so the run skips it (and the full run stays within its time)."""
    return "error" in summary or summary["wall_s"] > factor * arrival_span_s


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation: with a few samples p99 is the max)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def lab_summary(results: dict) -> dict:
    """The numbers the table shows from one results.json."""
    if "error" in results:
        return {"error": results["error"]}
    wall = results["run"]["wall_s"]
    lanes = {}
    all_met = True
    for name, lane in results["lanes"].items():
        stats = lane["stats"]
        met = lane["slo"].get("met")
        all_met &= met is not False
        lanes[name] = {"ttft_p99_s": stats["ttft"]["p99"], "ttft_p50_s": stats["ttft"]["p50"],
                       "itl_p99_s": stats["itl"]["p99"], "slo_attainment": lane["slo"]["attainment"],
                       "slo_met": met, "errors": lane["errors"], "requests": lane["requests"]}
    met_requests = sum(lane["slo"].get("met_requests", 0) for lane in results["lanes"].values())
    # warm prefix: the requests the server says hit its cache, or, where it says nothing, all but the first
    done = [r for r in results.get("requests", []) if r.get("error") is None and r.get("ttft_s") is not None]
    warm = [r["ttft_s"] for r in done if (r.get("cached_tokens") or 0) > 0]
    basis = "server-reported cache hits"
    if not warm:
        warm, basis = [r["ttft_s"] for r in sorted(done, key=lambda r: r["index"])[1:]], "all but the first request"
    return {"lanes": lanes, "warm_ttft_p50_s": percentile(warm, 50), "warm_ttft_p99_s": percentile(warm, 99),
            "warm_n": len(warm), "warm_basis": basis, "all_slos_met": all_met, "slo_goodput_rps": met_requests / wall if wall else None,
            "errors": results["total"]["errors"], "wall_s": wall, "late_requests": results["client"]["late_requests"],
            "fell_behind": results["client"]["fell_behind"]}


# -- the run ------------------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    path = WORK / "versions.txt"
    if path.is_file():
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.partition(" ")
                out[key] = value
    try:
        out["twospeed"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=ROOT).stdout.strip()
    except OSError:
        pass
    return out


def measure_engine(engine: str, dtype: str, cfg: RunConfig, lab: bool, scratch: Path, monitor: LoadMonitor) -> dict:
    tokenizer_dir = model_dir(dtype)
    result: dict = {"engine": engine, "dtype": dtype}
    t0 = time.monotonic()
    try:
        with serve(engine, dtype) as server:
            result["startup_s"] = time.monotonic() - t0
            result["command"] = " ".join(f"{k}={v}" for k, v in server.env.items()) + " " + " ".join(server.command)
            warm_up(server, PromptMaker(tokenizer_dir, salt(), cfg.seed))
            mark = monitor.mark()
            result["batch1"] = batch1(server, cfg, tokenizer_dir)
            print(f"  {engine} {dtype} batch 1: TTFT {result['batch1']['ttft_s'] * 1e3:.0f} ms, "
                  f"decode {result['batch1']['decode_tok_s']:.1f} tok/s", flush=True)
            result["concurrent"] = {}
            for level in cfg.conc_levels:
                r = concurrent(server, cfg, tokenizer_dir, level)
                result["concurrent"][str(level)] = r
                print(f"  {engine} {dtype} {level} concurrent: {r['output_tok_s']:.0f} output tok/s", flush=True)
            result["load_own_client"] = monitor.since(mark)
            if lab:
                mark = monitor.mark()
                result["mixed"] = {}
                for rate in cfg.mixed_rates:
                    raw = lab_run(server, cfg, "mixed", cfg.mixed_requests, rate,
                                  scratch / f"{engine}-{dtype}-mixed-{rate}", tokenizer_dir)
                    s = result["mixed"][str(rate)] = lab_summary(raw)
                    print(f"  {engine} {dtype} mixed @ {rate}/s: {json.dumps(s)[:300]}", flush=True)
                    if saturated(s, cfg.mixed_requests / rate, cfg.saturation_factor):
                        print(f"  {engine} {dtype} saturated at {rate}/s: higher rates skipped", flush=True)
                        break
                raw = lab_run(server, cfg, "agent", cfg.agent_requests, cfg.agent_rate,
                              scratch / f"{engine}-{dtype}-agent", tokenizer_dir)
                result["agent"] = lab_summary(raw)
                print(f"  {engine} {dtype} agent: {json.dumps(result['agent'])[:300]}", flush=True)
                result["load_lab"] = monitor.since(mark)
    except Exception as e:  # one engine failing must not lose the others' numbers
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"  {engine} {dtype} FAILED: {result['error'][:2000]}", flush=True)
    result["total_s"] = time.monotonic() - t0
    return result


# -- the table ---------------------------------------------------------------------------------------------
def ratio(value: float | None, best: float | None, higher_is_better: bool) -> str:
    if value is None or best is None or value <= 0 or best <= 0:
        return "-"
    return f"{(value / best) if higher_is_better else (best / value):.2f}"


def column(results: list[dict], get, higher_is_better: bool) -> list[tuple[float | None, str]]:
    values = []
    for r in results:
        try:
            values.append(get(r))
        except (KeyError, TypeError):
            values.append(None)
    good = [v for v in values if v is not None and v > 0]
    best = (max(good) if higher_is_better else min(good)) if good else None
    return [(v, ratio(v, best, higher_is_better)) for v in values]


def markdown(cfg: RunConfig, results: list[dict], meta: dict) -> str:
    lines = [f"## Peers: twospeed vs vLLM (CPU) vs llama.cpp — {meta['date']}", "",
             f"Command: `{meta['command']}` ({meta['wall_min']:.1f} min). Machine: {meta['machine']}. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}.", "",
             "Checkpoint: benchmarks/peers/make_checkpoint.py (bench_engine.py's ~100M Llama, random weights, "
             "a 32000-piece SentencePiece BPE tokenizer; GGUF by llama.cpp's convert_hf_to_gguf.py). "
             "Ratios are to the best engine in this run (1.00 = best; for TTFT best/value).", ""]
    for dtype in cfg.dtypes:
        rs = [r for r in results if r["dtype"] == dtype]
        lines += [f"### {dtype}", "",
                  "| engine | TTFT 512 (ms) | × | decode b1 (tok/s) | × | "
                  + " | ".join(f"{c} conc. (out tok/s) | ×" for c in cfg.conc_levels)
                  + " | other load (cores) |",
                  "|---|---:|---:|---:|---:|" + "---:|---:|" * len(cfg.conc_levels) + "---:|"]
        cols = [column(rs, lambda r: r["batch1"]["ttft_s"], False),
                column(rs, lambda r: r["batch1"]["decode_tok_s"], True)]
        cols += [column(rs, lambda r, c=c: r["concurrent"][str(c)]["output_tok_s"], True) for c in cfg.conc_levels]
        for i, r in enumerate(rs):
            if "error" in r and "batch1" not in r:
                lines.append(f"| {r['engine']} | failed: {r['error'][:120]} |" + " |" * (3 + 2 * len(cfg.conc_levels)))
                continue
            cells = []
            for j, col in enumerate(cols):
                v, x = col[i]
                scale = 1e3 if j == 0 else 1
                cells += ["-" if v is None else f"{v * scale:.0f}" if j != 1 else f"{v:.1f}", x]
            load = r.get("load_own_client")
            lines.append(f"| {r['engine']} | " + " | ".join(cells) + f" | {'-' if load is None else f'{load:.2f}'} |")
        lines.append("")
        for r in rs:  # what failed, so a missing cell is explained
            for level, c in sorted(r.get("concurrent", {}).items()):
                if c.get("errors"):
                    lines.append(f"- {r['engine']}, {level} concurrent: {len(c['errors'])} of {c['requests']} requests "
                                 f"failed (tokens not counted), e.g. {c['errors'][0][:300]}")
            if "error" in r and "batch1" in r:
                lines.append(f"- {r['engine']}: stopped after a failure: {r['error'][:400]}")
        if lines[-1] != "":
            lines.append("")
        if any("mixed" in r for r in rs):
            lines += _lab_tables(cfg, rs)
    lines += ["Settings (benchmarks/peers/serve.py `Settings`): "
              + ", ".join(f"{k}={v}" for k, v in asdict(SETTINGS).items() if v not in ([], None)) + ".", ""]
    for r in results:
        if "command" in r:
            lines.append(f"- {r['engine']} {r['dtype']} (ready in {r.get('startup_s', 0):.0f} s): `{r['command']}`")
    lines += ["", f"Run config: {json.dumps(asdict(cfg))}", ""]
    return "\n".join(lines) + "\n"


def _lab_tables(cfg: RunConfig, rs: list[dict]) -> list[str]:
    lanes = sorted({lane for r in rs for s in r.get("mixed", {}).values() for lane in s.get("lanes", {})})
    lines = [f"`mixed` workload (twospeed bench, {cfg.mixed_requests} requests a rate, scale {cfg.lab_scale}, "
             f"prompts capped at {cfg.lab_max_prompt_tokens} tokens): per lane TTFT p99 / ITL p99 (ms) and SLO "
             "attainment; SLO goodput = requests meeting their lane's SLO per second.", "",
             "| engine | rate (req/s) | " + " | ".join(lanes) + " | SLO goodput (req/s) | × | all SLOs met |",
             "|---|---:|" + "---|" * len(lanes) + "---:|---:|---|"]
    for rate in cfg.mixed_rates:
        col = column(rs, lambda r, k=str(rate): r["mixed"][k]["slo_goodput_rps"], True)
        for i, r in enumerate(rs):
            s = r.get("mixed", {}).get(str(rate))
            if s is None:
                if r.get("mixed"):
                    lines.append(f"| {r['engine']} | {rate} | " + " | ".join("-" for _ in lanes)
                                 + " | skipped: saturated at a lower rate | | |")
                continue
            if "error" in s:
                lines.append(f"| {r['engine']} | {rate} | " + " | ".join("-" for _ in lanes)
                             + f" | {s['error'][:80]} | | |")
                continue
            cells = []
            for lane in lanes:
                ln = s["lanes"].get(lane)
                if ln is None:
                    cells.append("-")
                    continue
                ttft = "-" if ln["ttft_p99_s"] is None else f"{ln['ttft_p99_s'] * 1e3:.0f}"
                itl = "-" if ln["itl_p99_s"] is None else f"{ln['itl_p99_s'] * 1e3:.0f}"
                att = "-" if ln["slo_attainment"] is None else f"{ln['slo_attainment'] * 100:.0f}%"
                cells.append(f"{ttft} / {itl} / {att}")
            v, x = col[i]
            lines.append(f"| {r['engine']} | {rate} | " + " | ".join(cells)
                         + f" | {'-' if v is None else f'{v:.2f}'} | {x} | {'yes' if s['all_slos_met'] else 'no'} |")
    lines.append("")
    sustained = []
    for r in rs:
        ok = [rate for rate in cfg.mixed_rates if r.get("mixed", {}).get(str(rate), {}).get("all_slos_met")]
        sustained.append(f"{r['engine']} {max(ok) if ok else 'none'}")
    lines += [f"Highest rate with every lane within its SLO (of those tried): {', '.join(sustained)}.", ""]
    col50 = column(rs, lambda r: r["agent"]["warm_ttft_p50_s"], False)
    col99 = column(rs, lambda r: r["agent"]["warm_ttft_p99_s"], False)
    lines += [f"`agent` workload ({cfg.agent_requests} requests at {cfg.agent_rate}/s): TTFT (ms) of the requests "
              "whose shared prefix was warm (p99 is nearest-rank), × best; all requests' p50 for reference.", "",
              "| engine | warm TTFT p50 | × | warm TTFT p99 | × | warm requests (basis) | all TTFT p50 |",
              "|---|---:|---:|---:|---:|---|---:|"]
    for i, r in enumerate(rs):
        (v50, x50), (v99, x99) = col50[i], col99[i]
        a = r.get("agent", {})
        f = (lambda v: "-" if v is None else f"{v * 1e3:.0f}")
        all50 = a.get("lanes", {}).get("agent", {}).get("ttft_p50_s")
        lines.append(f"| {r['engine']} | {f(v50)} | {x50} | {f(v99)} | {x99} | {a.get('warm_n', '-')} "
                     f"({a.get('warm_basis', a.get('error', '-'))}) | {f(all50)} |")
    lines.append("")
    return lines


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical CPUs"
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes; writes only with --out")
    ap.add_argument("--out", help="markdown file to append the table to (default: BENCHMARKS.md, not with --quick)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--dtypes", default="bf16", help="bf16, fp32 or both (comma-separated)")
    ap.add_argument("--no-lab", action="store_true", help="skip (3) and (4) even if `twospeed bench` exists")
    ap.add_argument("--json", help="also write every number to this JSON file")
    args = ap.parse_args()
    engines = tuple(args.engines.split(","))
    dtypes = tuple(args.dtypes.split(","))
    if bad := [e for e in engines if e not in ENGINES]:
        ap.error(f"unknown engine(s) {bad}; choose from {ENGINES}")
    if bad := [d for d in dtypes if not (model_dir(d) / "tokenizer.json").is_file()]:
        ap.error(f"no checkpoint for {bad}: run make_checkpoint.py with the converter venv (see --help)")
    cfg = RunConfig(engines=engines, dtypes=dtypes, **(QUICK if args.quick else {}))
    out = Path(args.out) if args.out else (None if args.quick else ROOT / "BENCHMARKS.md")
    lab = not args.no_lab and lab_available()
    print(f"engines {engines}, dtypes {dtypes}, lab {'yes' if lab else 'no (twospeed bench not available)'}",
          flush=True)
    t0 = time.monotonic()
    # every lab run's results.json / report.html stay here for digging (git-ignored)
    scratch = WORK / "runs" / datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    scratch.mkdir(parents=True, exist_ok=True)
    results = []
    with LoadMonitor() as monitor:
        for dtype in dtypes:
            for engine in engines:
                print(f"{engine} {dtype} ...", flush=True)
                results.append(measure_engine(engine, dtype, cfg, lab, scratch, monitor))
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/peers/run_peers.py " + " ".join(sys.argv[1:]),
            "wall_min": (time.monotonic() - t0) / 60, "machine": machine(), "versions": versions()}
    text = markdown(cfg, results, meta).replace(str(ROOT) + "/", "")  # paths relative to the repository
    print(text)
    everything = json.dumps({"meta": meta, "config": asdict(cfg), "results": results}, indent=1, default=str)
    (scratch / "peers.json").write_text(everything)
    print(f"lab results and peers.json in {scratch}")
    if args.json:
        Path(args.json).write_text(everything)
    if out is not None:
        with open(out, "a") as f:
            f.write("\n" + text)
        print(f"appended to {out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
