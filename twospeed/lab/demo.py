"""`make demo`: the lab in two minutes. Starts `twospeed serve` on the demo model twice (chunked prefill on,
then off), replays the same short `mixed` workload against each, prints the comparison, and ends with each
run's diagnosis (which speed hurt each lane, and which lever to pull), so a newcomer sees what a long prompt
does to everyone else's ITL and what the prefix cache does to TTFT.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from twospeed.lab.bench import BenchConfig, run_bench
from twospeed.lab.compare import check_comparable, print_comparison
from twospeed.lab.diagnose import print_diagnosis
from twospeed.lab.local_server import LocalServer
from twospeed.lab.report import print_summary

# The demo model holds 4096 tokens; prompts are capped so prompt + the longest answer (400) fit.
MAX_PROMPT_TOKENS = 3600
SERVER_FLAGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "256"]
CONFIGS = (("chunked prefill on", ["--enable-chunked-prefill", "true"]),
           ("chunked prefill off", ["--enable-chunked-prefill", "false"]))


def run_lab_demo(requests: int, rate: float, scale: float, seed: int, out: str) -> int:
    from twospeed.model.demo import demo_checkpoint_path

    console = Console()
    if console.width < 150 and not console.is_terminal:
        console = Console(width=150)
    console.print("[bold]twospeed lab demo[/bold]: building the demo checkpoint if needed ...")
    demo_checkpoint_path()
    docs = []
    for label, flags in CONFIGS:
        console.print(f"[bold]{label}[/bold]: starting `twospeed serve --model demo {' '.join(SERVER_FLAGS + flags)}`")
        with LocalServer("demo", SERVER_FLAGS + flags) as server:
            cfg = BenchConfig(url=server.url, model="demo", workload="mixed", requests=requests, rate=rate,
                              seed=seed, out=str(Path(out) / label.replace(" ", "-")), tokenizer="demo",
                              scale=scale, max_prompt_tokens=MAX_PROMPT_TOKENS, ignore_eos=True, label=label)
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
