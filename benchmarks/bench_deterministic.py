"""What the deterministic mode costs and what it buys, in-process, one engine after the other in one process.

    .venv/bin/python benchmarks/bench_deterministic.py                       # smollm2, the dtype auto picks
    .venv/bin/python benchmarks/bench_deterministic.py --model demo --dtype bfloat16

For the default mode and `deterministic=True`:
  cost      TTFT of a 512-token prompt; batch-1 decode tok/s (128 greedy tokens); 8 and 32 streams' output
            tok/s (2 x N requests of 256 in, 128 out, N at a time), the shapes bench_served uses in-process
  identity  greedy answers (96 tokens) to a few chat prompts: alone against beside a random batch (three
            batches each), and with prompt-lookup speculation against without; counted identical to the token
Never run it beside other work: two cores.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from twospeed import LLM, SamplingParams

CHATS = ["Write a short poem about the sea.", "Explain what a KV cache is in two sentences.",
         "List three uses of a hash map.", "Summarise the plot of Hamlet briefly.",
         "Give me a recipe for pancakes.", "What is the capital of Australia and why?"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def cost(llm: LLM, vocab: int) -> dict:
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, min(vocab, 8000)) for _ in range(n)]  # noqa: E731
    llm.generate([ids(64) for _ in range(4)], greedy(8))  # warm up
    o = llm.generate([ids(512)], greedy(128))[0]
    out = {"ttft_s": o.clock.ttft, "b1_tok_s": (len(o.token_ids) - 1) / (o.clock.ttlt - o.clock.ttft)}
    for level in (8, 32):
        llm.engine.scheduler.cfg.max_num_seqs = level
        t0 = time.perf_counter()
        outs = llm.generate([ids(256) for _ in range(2 * level)], greedy(128))
        out[f"c{level}_tok_s"] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    llm.engine.scheduler.cfg.max_num_seqs = 32
    return out


def prompts_for(llm: LLM, vocab: int) -> list:
    tok = llm.engine.tokenizer
    if tok is not None and tok.chat_template:
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
                for c in CHATS]
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 80))] for _ in CHATS]


def identity(model: str, kwargs: dict, vocab: int) -> dict:
    llm = LLM(model, **kwargs)
    prompts = prompts_for(llm, vocab)
    alone = [llm.generate([p], greedy(96))[0].token_ids for p in prompts]
    rng = random.Random(2)
    batched_same = 0
    for p, ref in zip(prompts, alone):
        same = True
        for _ in range(3):
            others = [[rng.randrange(3, min(vocab, 8000)) for _ in range(rng.randint(5, 300))]
                      for _ in range(rng.randint(2, 7))]
            outs = llm.generate([p] + others, [greedy(96)] + [greedy(rng.randint(4, 64)) for _ in others])
            same &= outs[0].token_ids == ref
        batched_same += same
    spec = LLM(model, spec_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=4,
               spec_auto_fallback=False, **kwargs)
    spec_outs = spec.generate(prompts, greedy(96))
    return {"batched_identical": f"{batched_same}/{len(prompts)}",
            "spec_identical": f"{sum(o.token_ids == a for o, a in zip(spec_outs, alone))}/{len(prompts)}",
            "spec_accepted": sum(o.spec.accepted for o in spec_outs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-cost", action="store_true")
    args = ap.parse_args()
    rows = []
    for deterministic in (False, True):
        kwargs = dict(dtype=args.dtype, deterministic=deterministic, max_model_len=2048, kv_cache_memory_gb=2,
                      max_num_seqs=32)
        llm = LLM(args.model, **kwargs)
        vocab = llm.engine.model_config.vocab_size
        dtype = str(llm.engine.dtype).removeprefix("torch.")
        row = {"mode": "deterministic" if deterministic else "default", "dtype": dtype}
        if not args.no_cost:
            row |= cost(llm, vocab)
        del llm
        row |= identity(args.model, kwargs, vocab)
        rows.append(row)
        print(row, flush=True)
    print(f"\n{args.model}, in-process")
    print("| mode | dtype | 512-token TTFT (s) | b1 decode tok/s | c8 tok/s | c32 tok/s | alone = batched | "
          "spec = plain (accepted) |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        c = [f"{r[k]:.3f}" if k == "ttft_s" else f"{r[k]:.1f}" for k in ("ttft_s", "b1_tok_s", "c8_tok_s",
                                                                         "c32_tok_s") if k in r] or ["-"] * 4
        print(f"| {r['mode']} | {r['dtype']} | {' | '.join(c)} | {r['batched_identical']} | "
              f"{r['spec_identical']} ({r['spec_accepted']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
