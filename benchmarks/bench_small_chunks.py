"""What a prompt chunk costs beside running decodes: a mixed step against its parts, on the ~100M Llama.

Run:  .venv/bin/python benchmarks/bench_small_chunks.py [--model PATH] [--threads 1] [--repeats 40]
          [--chunks 64,128,256] [--decodes 8,16,32] [--chunk-context 1024] [--decode-context 512] [--quick]

Time-sized steps (SchedulerConfig.target_step_ms) only pay off if a small chunk is cheap: a step that carries a
128-token chunk beside 16 decodes should cost little more than the chunk alone plus the decodes alone (target:
at most 1.3x their sum). For each (chunk, decodes) pair this builds three steps on one engine, with the KV of
every context already in the cache, and times each the way the engine runs it (runner.execute + the sampler):
  chunk    `chunk` prompt tokens at positions [chunk-context, chunk-context + chunk) of one request;
  decodes  `decodes` streams, one token each, at `decode-context` tokens of context;
  mixed    both in one step.
Each step is repeated (the same positions are recomputed: the KV written is the same), round-robin over the
three, and the minimum and median of --repeats runs are printed: on a shared machine the minimum is the
contention-robust number. --threads 1 (the default) also keeps OpenMP workers from spinning against other
tenants. The model is bench_engine.py's ~100M Llama (random weights, bf16) unless --model names a folder.
Nothing is written to BENCHMARKS.md; paste the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import cpu_model, git_state, write_checkpoint  # noqa: E402

from twospeed import LLM  # noqa: E402
from twospeed.engine.request import Request  # noqa: E402
from twospeed.engine.sampling_params import SamplingParams  # noqa: E402
from twospeed.engine.scheduler import ScheduledChunk  # noqa: E402


class StepBuilder:
    """Requests whose KV is already in the cache (computed once), and chunks over them to time again and again."""

    def __init__(self, llm: LLM):
        self.eng = llm.engine
        self.n = 0

    def _request(self, ctx: int, extra: int, decoding: bool) -> Request:
        """A request with `ctx` computed tokens; `extra` more prompt tokens to chunk, or a sampled token to decode."""
        eng = self.eng
        ids = [3 + (i * 7919 + self.n) % 31000 for i in range(ctx + extra)]
        req = Request(f"bench-{self.n}", ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                      max_output_tokens=4)
        self.n += 1
        assert eng.kv.allocate_slots(req.request_id, ctx + extra + 1), "KV pool too small"
        # compute the context once, 512 tokens a step, so the timed steps read real KV
        for start in range(0, ctx, 512):
            n = min(512, ctx - start)
            eng.runner.execute([ScheduledChunk(req, start, n)], eng.kv)
        req.num_computed_tokens = ctx
        req.high_water = ctx
        if decoding:  # the prompt is done and one token was sampled: its next chunk is a decode
            req.append_token(5, time.monotonic())
            req.num_computed_tokens = req.high_water = req.num_tokens - 1
        return req

    def chunk(self, ctx: int, n: int) -> ScheduledChunk:
        req = self._request(ctx, n, decoding=False)
        return ScheduledChunk(req, ctx, n)

    def decodes(self, ctx: int, count: int) -> list[ScheduledChunk]:
        reqs = [self._request(ctx - 1, 1, decoding=True) for _ in range(count)]
        return [ScheduledChunk(r, r.num_computed_tokens, 1) for r in reqs]

    def run(self, chunks: list[ScheduledChunk]) -> float:
        eng = self.eng
        t = time.perf_counter()
        logits, sampling, _ = eng.runner.execute(chunks, eng.kv)
        if sampling:
            eng.sampler(logits, [c.request for c in sampling])
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a bf16 checkpoint folder (default: bench_engine.py's ~100M Llama, built)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--chunks", default="64,128,256", help="prompt tokens per chunk, comma-separated")
    ap.add_argument("--decodes", default="8,16,32", help="decode streams, comma-separated")
    ap.add_argument("--chunk-context", type=int, default=1024, help="tokens already computed before the chunk")
    ap.add_argument("--decode-context", type=int, default=512, help="context of each decode stream")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, few repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.chunks, args.decodes = 3, "32", "4"
        args.chunk_context, args.decode_context = 64, 32
    torch.set_num_threads(args.threads)
    chunk_sizes = [int(x) for x in args.chunks.split(",")]
    decode_counts = [int(x) for x in args.decodes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = str(Path(tmp) / "ckpt")
            write_checkpoint(Path(path), torch.bfloat16, seed=0)
        tokens = len(chunk_sizes) * (args.chunk_context + max(chunk_sizes) + 1)
        tokens += len(chunk_sizes) * len(decode_counts) * max(decode_counts) * (args.decode_context + 1)
        llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, num_gpu_blocks=tokens // 16 + 64,
                  max_num_batched_tokens=4096, cost_probe=False)
        build = StepBuilder(llm)
        rows = []
        for n in chunk_sizes:
            chunk = build.chunk(args.chunk_context, n)
            for d in decode_counts:
                decodes = build.decodes(args.decode_context, d)
                steps = {"chunk": [chunk], "decodes": decodes, "mixed": decodes + [chunk]}
                times: dict[str, list[float]] = {k: [] for k in steps}
                for name, s in steps.items():  # warm-up
                    build.run(s)
                for _ in range(args.repeats):
                    for name, s in steps.items():
                        times[name].append(build.run(s))
                low = {k: min(v) for k, v in times.items()}
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append((n, d, low, med))
                print(f"chunk {n} + {d} decodes: " + ", ".join(
                    f"{k} {low[k] * 1e3:.2f} ms (median {med[k] * 1e3:.2f})" for k in steps)
                    + f"; mixed / (chunk + decodes) = {low['mixed'] / (low['chunk'] + low['decodes']):.2f}",
                    flush=True)
    cmd = "python benchmarks/bench_small_chunks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n`{cmd.strip()}` at {git_state()}; {cpu_model()}, {args.threads} thread(s); min (median) of "
          f"{args.repeats} runs, round-robin; chunk at context {args.chunk_context}, decodes at context "
          f"{args.decode_context}.\n")
    print("| chunk | decodes | chunk alone (ms) | decodes alone (ms) | mixed (ms) | mixed / sum (target <= 1.3) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, d, low, med in rows:
        ratio = low["mixed"] / (low["chunk"] + low["decodes"])
        print(f"| {n} | {d} | {low['chunk'] * 1e3:.2f} ({med['chunk'] * 1e3:.2f}) | {low['decodes'] * 1e3:.2f} "
              f"({med['decodes'] * 1e3:.2f}) | {low['mixed'] * 1e3:.2f} ({med['mixed'] * 1e3:.2f}) | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
