"""The lab on a real GGUF model: twospeed (the file dequantized into bf16) and llama.cpp's llama-server (the same
file, its own Q4_1 kernels), one after another in one sitting, through `twospeed bench`.

    .venv/bin/python benchmarks/bench_gguf_lab.py --out /tmp/gguf-lab.md        # smollm2, fetched once
    .venv/bin/python benchmarks/bench_gguf_lab.py --model path/to/model.gguf --rates 0.5

Each engine serves the file with benchmarks/peers/serve.py's settings; the lab replays the `tasks` workload as
chat requests (the server's chat template: an instruct model's prompts) at each rate with the same seed and a salt
per rate, so both engines get the same requests and every run starts with a cold prefix cache. Reported per engine and rate: TTFT p50/p99 and ITL p99 per lane, output tok/s, and
each lane's gate pass rate (what the model really answers: agent and nightly with and without the grammar; a
server without structured output fails the constrained lanes' gates the way its free lanes do). Never run it
beside other work: two cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "peers"))

from serve import SETTINGS, WORK, free_port, launch, llama_command, twospeed_command  # noqa: E402

LANES = ("agent", "agent-free", "rag", "chat", "nightly", "nightly-free")


def run_lab(url: str, model: str, rate: float, requests: int, seed: int, out: Path, tokenizer: str) -> dict:
    cmd = [str(ROOT / ".venv/bin/twospeed"), "bench", "--url", url, "--model", model, "--workload", "tasks",
           "--endpoint", "chat", "--rate", str(rate), "--requests", str(requests), "--seed", str(seed),
           "--salt", f"gguf-lab-{seed}-{rate:g}", "--tokenizer", tokenizer, "--out", str(out), "--no-progress",
           "--max-prompt-tokens", "1600"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())


def row(engine: str, rate: float, doc: dict) -> str:
    cells = []
    for name in LANES:
        lane = doc["lanes"].get(name)
        if lane is None:
            cells.append("—")
            continue
        ttft, itl, gate = lane["stats"].get("ttft", {}), lane["stats"].get("itl", {}), lane.get("gate") or {}
        passed = gate.get("rate")
        errors = f" ({lane['errors']} err)" if lane.get("errors") else ""
        cells.append(f"{_s(ttft.get('p50'))}/{_s(ttft.get('p99'))} · {_s(itl.get('p99'))} · "
                     f"{'—' if passed is None else f'{passed:.0%}'}{errors}")
    out_tps = doc["total"]["throughput"]["output_tokens_per_s"]
    return f"| {engine} | {rate:g}/s | " + " | ".join(cells) + f" | {out_tps:.1f} |"


def _s(v) -> str:
    return "—" if v is None else f"{v:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2 (the built-in, fetched once)")
    ap.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[0.5, 1.0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="twospeed,llama")
    ap.add_argument("--out", default=None, help="markdown file to append to (default: print)")
    args = ap.parse_args()
    if args.model == "smollm2":
        from twospeed.builtin.smollm2 import smollm2_path

        gguf = smollm2_path()
    else:
        gguf = Path(args.model)
    name = gguf.stem
    runs = WORK / "gguf-lab"
    lines = [f"#### The lab on {gguf.name}: twospeed (bf16 from the file) vs llama.cpp (the same file), "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "", f"`tasks` workload as chat, {args.requests} requests per run, seed {args.seed}. Cells: TTFT p50/p99 "
             "(s) · ITL p99 (s) · gate pass rate.", "",
             "| engine | rate | " + " | ".join(LANES) + " | out tok/s |", "|---|---|" + "---|" * len(LANES) + "---:|"]
    for engine in args.engines.split(","):
        port = free_port()
        if engine == "twospeed":
            cmd, env = twospeed_command(gguf, name, port, SETTINGS), {"OMP_NUM_THREADS": str(SETTINGS.threads)}
        else:
            # --no-repack: llama.cpp's repacked path for Q4_1 (AMX int8 where the compiler targets it) dies with
            # an illegal instruction on a VM that runs twospeed's AMX bf16 tiles; its plain kernels serve the file
            cmd = llama_command(WORK / "llama-build/bin/llama-server", gguf, name, port, SETTINGS) + ["--no-repack"]
            env = {"OMP_NUM_THREADS": str(SETTINGS.threads)}
        with launch(engine, f"gguf-{name}", cmd, env, port, name) as server:
            for rate in args.rates:
                doc = run_lab(server.url + "/v1", name, rate, args.requests, args.seed,
                              runs / f"{engine}-{rate:g}", str(gguf))
                lines.append(row(engine, rate, doc))
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
