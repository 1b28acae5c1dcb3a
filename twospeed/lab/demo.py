"""`make demo`: the lab in two minutes. Starts `twospeed serve` on the built-in `demo-task` model twice
(chunked prefill on, then off), replays the same short `tasks` workload against each, prints the comparison,
and ends with each run's diagnosis (which speed hurt each lane, and which lever to pull), so a newcomer sees
what a long prompt does to everyone else's ITL, what the prefix cache does to TTFT, and gate pass rates and
goodput that mean something: demo-task was trained on these prompts' formats (its first use trains it, a few
minutes), so its tool calls, citations and codes are real answers, with and without structured output.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from twospeed.lab.bench import BenchConfig, run_bench
from twospeed.lab.compare import check_comparable, print_comparison
from twospeed.lab.diagnose import print_diagnosis
from twospeed.lab.local_server import LocalServer
from twospeed.lab.report import print_summary

MODEL = "demo-task"  # trained on the task prompts' formats (the random-weight `demo` fails every gate)
WORKLOAD = "tasks"  # the mixed lanes on task prompts, sized for demo-task
# demo-task holds 2048 tokens; prompts are capped so prompt + the longest answer (400) fit.
MAX_PROMPT_TOKENS = 1600
SERVER_FLAGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "256"]
CONFIGS = (("chunked prefill on", ["--enable-chunked-prefill", "true"]),
           ("chunked prefill off", ["--enable-chunked-prefill", "false"]))


def run_lab_demo(requests: int, rate: float, scale: float, seed: int, out: str) -> int:
    from twospeed.model.builtin import builtin_checkpoint_path

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)
    console.print(f"[bold]twospeed lab demo[/bold]: building {MODEL!r} if needed (the first time trains it) ...")
    builtin_checkpoint_path(MODEL)
    docs = []
    for label, flags in CONFIGS:
        console.print(f"[bold]{label}[/bold]: starting `twospeed serve --model {MODEL} {' '.join(SERVER_FLAGS + flags)}`")
        with LocalServer(MODEL, SERVER_FLAGS + flags) as server:
            # Not ignore_eos: a trained model ends its answers, and text past the end would fail the gates.
            cfg = BenchConfig(url=server.url, model=MODEL, workload=WORKLOAD, requests=requests, rate=rate,
                              seed=seed, out=str(Path(out) / label.replace(" ", "-")), tokenizer=MODEL,
                              scale=scale, max_prompt_tokens=MAX_PROMPT_TOKENS, label=label)
            doc = run_bench(cfg, console)
        print_summary(doc, console)
        docs.append(doc)
    check_comparable(docs)
    console.print("[bold]The same workload, chunked prefill on (base) vs off[/bold]")
    print_comparison(docs, console)
    for doc in docs:
        print_diagnosis(doc, console, doc["run"]["label"])
    console.print(f"Runs, requests.csv and report.html with plots are in {out}/; compare them again with "
                  f"`twospeed compare {out}/chunked-prefill-on {out}/chunked-prefill-off`.")
    return 0
