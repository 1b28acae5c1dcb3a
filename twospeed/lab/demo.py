"""`make demo`: the lab on the trained built-in model. Builds `demo-task` on first use (model/task_model.py:
minutes, once, cached), starts `twospeed serve` on it twice (chunked prefill on, then off), replays the same
short `tasks` workload against each (the mixed lanes on prompts in the formats the model learnt, agent and
nightly with and without the grammar), prints the comparison, and ends with each run's diagnosis (which speed
hurt each lane, and which lever to pull). So a newcomer sees what a long prompt does to everyone else's ITL,
what the prefix cache does to TTFT, and gate pass rates and goodput that judge real answers (the random `demo`
fails every gate, as it should).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from twospeed.lab.bench import BenchConfig, run_bench
from twospeed.lab.compare import check_comparable, print_comparison
from twospeed.lab.diagnose import print_diagnosis
from twospeed.lab.local_server import LocalServer
from twospeed.lab.report import print_summary

MODEL, WORKLOAD = "demo-task", "tasks"
# demo-task holds 2048 positions; prompts are capped so prompt + the longest answer (400) fit (the tasks
# workload's longest, rag's, are 900 tokens).
MAX_PROMPT_TOKENS = 1600
SERVER_FLAGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "256"]
CONFIGS = (("chunked prefill on", ["--enable-chunked-prefill", "true"]),
           ("chunked prefill off", ["--enable-chunked-prefill", "false"]))


def run_lab_demo(requests: int, rate: float, scale: float, seed: int, out: str) -> int:
    from twospeed.model.builtin import builtin_checkpoint_path

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)
    console.print(f"[bold]twospeed lab demo[/bold]: building `{MODEL}` if the cache does not hold it "
                  "(trained here on first use: minutes, once) ...")
    builtin_checkpoint_path(MODEL)
    docs = []
    for label, flags in CONFIGS:
        console.print(f"[bold]{label}[/bold]: starting `twospeed serve --model {MODEL} "
                      f"{' '.join(SERVER_FLAGS + flags)}`")
        with LocalServer(MODEL, SERVER_FLAGS + flags) as server:
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
