"""Build a task model (builtin/task_model.py) and report its training cost and its held-out pass rates.

    python benchmarks/bench_task_model.py                      # demo-task as built in, into a temp folder
    python benchmarks/bench_task_model.py --steps 600 --out /tmp/t  # a variant of the recipe
    python benchmarks/bench_task_model.py --time-steps 12        # estimate the training time, do not train

Prints the build's wall time and CPU time (user + sys of this process: on a loaded machine, CPU time / the
training threads is the quiet-machine estimate), then per lane, on held-out corpus seeds, greedy and bf16
through `LLM.generate`: each gate's pass rate and the share of answers with the right content. `--chat`
sends the prompts through the chat template instead. `--time-steps K` times K steps spread over the run
(each the min of `--repeats` tries, so other load on the machine mostly drops out) and prints the
estimated training time: the mean step times the steps, plus the data pipeline. Nothing here is a test; the bars live in
tests/builtin/test_task_model.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twospeed.builtin import task_corpus, task_data, task_model  # noqa: E402
from twospeed.lab import task_prompts  # noqa: E402

MAX_TOKENS = {"agent": 96, "rag": 96, "nightly": 48, "refusal": 64, "chat": 400}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def heldout(n: int, seed: str = "bench-heldout") -> list[task_corpus.TaskExample]:
    rng = random.Random(seed)
    return [task_corpus.sample(lane, rng) for lane in task_corpus.LANES for _ in range(n)]


def evaluate(model: str, examples: list[task_corpus.TaskExample], chat: bool = False) -> dict[str, dict[str, float]]:
    from twospeed import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory_gb=0.5)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}]) if chat else e.prompt
               for e in examples]
    if chat:
        prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = [SamplingParams(max_tokens=MAX_TOKENS[e.lane], temperature=0) for e in examples]
    outs = llm.generate(prompts, params)
    table: dict[str, dict[str, float]] = {}
    for e, o in zip(examples, outs):
        row = table.setdefault(e.lane, {"n": 0})
        row["n"] += 1
        for name, ok in task_prompts.judge(e, o.text).items():
            row[name] = row.get(name, 0) + ok
    for row in table.values():
        for k in row:
            if k != "n":
                row[k] = round(row[k] / row["n"], 3)
    return table


def estimate_training(spec: task_model.TaskModelSpec, k: int, repeats: int) -> None:
    """Min-of-`repeats` wall time of `k` steps drawn evenly from the run's own batches (the curriculum's
    short and long ones), with the build's thread count, scaled to `spec.steps`."""
    import torch

    tokenizer = task_model.build_task_tokenizer()
    cpu = cpu_seconds()
    stream = [b for _, b in zip(range(spec.steps), task_data.batches(spec, tokenizer))]
    data = cpu_seconds() - cpu  # one thread, the pipeline's cost for the whole run
    picked = stream[:: max(1, len(stream) // k)][:k]
    torch.set_num_threads(task_model.TRAIN_THREADS)
    model, opt = task_model.new_model(spec)
    bf16 = task_model.bf16_matmuls()
    task_model.train_step(spec, model, opt, picked[0], bf16)  # warm-up: oneDNN primitives, the allocator
    best, best_cpu = [], []
    for seqs in picked:
        times, cpus = [], []
        for _ in range(repeats):
            start, cpu = time.perf_counter(), time.process_time()
            task_model.train_step(spec, model, opt, seqs, bf16)
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        best.append(min(times))
        best_cpu.append(min(cpus))
    step, step_cpu = sum(best) / len(best), sum(best_cpu) / len(best_cpu)
    print(f"{spec.model_config().num_params / 1e6:.1f}M params, {task_model.TRAIN_THREADS} threads, bf16 {bf16}: "
          f"step {step * 1e3:.0f} ms wall (min of {repeats}, mean over {len(best)} steps; {min(best) * 1e3:.0f}-"
          f"{max(best) * 1e3:.0f} ms), {step_cpu * 1e3:.0f} ms CPU; data {data / spec.steps * 1e3:.0f} ms/step")
    print(f"{spec.steps} steps: ~{spec.steps * step + data:.0f} s at the measured wall time; a quiet machine "
          f"~{spec.steps * step_cpu / task_model.TRAIN_THREADS + data:.0f} s (CPU time / threads: the floor, "
          f"if the threads scale)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo-task", choices=sorted(task_model.TASK_SPECS))
    p.add_argument("--out", help="folder to write (default: a temp folder)")
    p.add_argument("--n", type=int, default=40, help="held-out prompts per lane")
    p.add_argument("--chat", action="store_true", help="also evaluate through the chat template")
    p.add_argument("--eval-only", help="evaluate this checkpoint folder, do not train")
    p.add_argument("--time-steps", type=int, help="estimate the training time from this many timed steps")
    p.add_argument("--repeats", type=int, default=5, help="tries per timed step (the min counts)")
    for f in dataclasses.fields(task_model.TaskModelSpec):
        if f.type in ("int", "float"):
            p.add_argument("--" + f.name.replace("_", "-"), type=int if f.type == "int" else float)
    args = p.parse_args()
    spec = task_model.TASK_SPECS[args.model]
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(spec)
                 if getattr(args, f.name, None) is not None}
    spec = dataclasses.replace(spec, **overrides)
    if args.time_steps:
        estimate_training(spec, args.time_steps, args.repeats)
        return 0
    if args.eval_only:
        path = Path(args.eval_only)
    else:
        path = Path(args.out or tempfile.mkdtemp(prefix="task-model-")) / "ckpt"
        wall, cpu = time.monotonic(), cpu_seconds()
        task_model.write_task_checkpoint(path, spec, args.model)
        wall, cpu = time.monotonic() - wall, cpu_seconds() - cpu
        print(f"built {path}: {spec.model_config().num_params / 1e6:.1f}M params, {spec.steps} steps, "
              f"wall {wall:.0f} s, cpu {cpu:.0f} s ({task_model.TRAIN_THREADS} threads: "
              f"quiet-machine estimate ~{cpu / task_model.TRAIN_THREADS / 0.85:.0f} s)")
    examples = heldout(args.n)
    for chat in (False, True) if args.chat else (False,):
        print("chat template" if chat else "completions")
        for lane, row in evaluate(str(path), examples, chat).items():
            print(f"  {lane:8s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
