"""The float32 prefill kernel on and off, alternated in one process, on a crowd-like schedule.

Run:  .venv/bin/python benchmarks/bench_crowd_chunks.py MODEL [--rounds 3] [--streams 8] [--requests 16]
          [--prompt 256] [--out-tokens 128] [--every 12]

A served crowd's prompts arrive while other streams decode, so the time-sized step cuts them into chunks beside
the decodes; where the model computes in float32 (a bf16 checkpoint on a CPU without bf16 instructions) each chunk
attends either in place (csrc/paged_attention.c's AVX2 prefill) or through the portable gather + SDPA. Served
figures on a 2-core VM drift by more than that difference from one run to the next, so this runs the same
schedule with each path in turn, in one engine: `streams` requests at once, then one more every `every` steps up
to `requests`, each `prompt` token ids in and `out-tokens` greedy tokens out; prints each run's wall time.
Nothing is written to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twospeed import LLM, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--every", type=int, default=12)
    args = ap.parse_args(argv)
    engine = LLM(args.model, max_model_len=4096, kv_cache_memory_gb=2, max_num_seqs=32).engine
    layers = [layer.self_attn.attn for layer in engine.runner.model.layers]
    if not all(getattr(a, "f32_prefill", False) for a in layers):
        print("this model or CPU does not take the float32 prefill kernel: nothing to compare")
        return 0
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.out_tokens, temperature=0, ignore_eos=True)

    def run(tag: str) -> float:
        prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt)] for _ in range(args.requests)]
        start, step = time.perf_counter(), 0
        added = min(args.streams, args.requests)
        for i in range(added):
            engine.add_request(f"{tag}-{i}", prompts[i], params)
        while added < args.requests or engine.has_unfinished_requests():
            if added < args.requests and step > 0 and step % args.every == 0:
                engine.add_request(f"{tag}-{added}", prompts[added], params)
                added += 1
            engine.step()
            step += 1
        return time.perf_counter() - start

    def use_kernel(on: bool) -> None:
        for a in layers:
            a.f32_prefill = on

    run("warm-up")
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            use_kernel(on)
            times[on].append(run(f"{on}-{r}"))
    use_kernel(True)
    tokens = args.requests * args.out_tokens
    for on, label in ((True, "in place (kernel)"), (False, "gather + SDPA")):
        print(f"{label}: " + ", ".join(f"{t:.2f} s ({tokens / t:.0f} tok/s)" for t in times[on]))
    print("portable / kernel, run by run: " + ", ".join(f"{b / a:.2f}" for a, b in zip(times[True], times[False])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
