"""Do the four implementations compute the same model? Greedy tokens of HF transformers, twospeed, vLLM and
llama.cpp on the peers' checkpoint, token for token, and whether their tokenizers split text the same way.

    .venv/bin/python benchmarks/peers/agreement.py [--dtypes bf16,fp32] [--new-tokens 32] [--engines ...]

Every engine gets the same prompt token ids (HF's tokenizer.json, BOS first) and runs greedy with EOS
ignored; HF is the reference (a plain greedy loop over its KV cache, so no generate() defaults intervene).
Where an engine departs from HF, the report gives the first differing position and HF's margin there
(top-1 minus top-2 logit): with random weights the logits are nearly flat, so a small margin means a
rounding-level tie, not a wrong model. Text tokenization is compared on the same prompts via each server's
/tokenize (twospeed and HF share tokenizer.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

from serve import DTYPES, model_dir, serve  # noqa: E402

PROMPTS = ("The order 4417 was delayed at the warehouse because",
           "Summarise the incident report: the cluster lost a replica during the deploy and",
           "{\"name\": \"lookup_order\", \"arguments\": {\"id\":",
           "café über 東京 — the customer asked for a refund on the invoice")


@dataclass(slots=True)
class Reference:
    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    margins: list[list[float]]  # top-1 minus top-2 logit at each generated position


def hf_reference(folder: Path, dtype: str, new_tokens: int) -> Reference:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, DTYPES[dtype])).eval()
    ref = Reference([], [], [])
    for text in PROMPTS:
        ids = tok.encode(text).ids
        out, margins = [], []
        with torch.inference_mode():
            res = model(torch.tensor([ids]), use_cache=True)
            for _ in range(new_tokens):
                logits = res.logits[0, -1].float()
                top = torch.topk(logits, 2)
                nxt = int(top.indices[0])
                out.append(nxt)
                margins.append(float(top.values[0] - top.values[1]))
                res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
        ref.prompt_ids.append(ids)
        ref.tokens.append(out)
        ref.margins.append(margins)
    del model
    return ref


def twospeed_tokens(folder: Path, dtype: str, ref: Reference, new_tokens: int) -> list[list[int]]:
    from twospeed import LLM, SamplingParams

    llm = LLM(str(folder), dtype=DTYPES[dtype])
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ref.prompt_ids, params)
    return [list(o.token_ids) for o in outs]


def server_tokens(engine: str, dtype: str, ref: Reference, new_tokens: int) -> tuple[list[list[int]], list[bool]]:
    """Greedy tokens from a served engine, and whether its /tokenize agrees with HF on each prompt."""
    tokens, same_split = [], []
    with serve(engine, dtype) as server, httpx.Client(timeout=300.0) as client:
        for text, ids in zip(PROMPTS, ref.prompt_ids):
            if engine == "llama":
                r = client.post(server.url + "/completion", json={
                    "prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                    "return_tokens": True, "cache_prompt": False, "repeat_penalty": 1.0, "seed": 0})
                r.raise_for_status()
                tokens.append(list(r.json()["tokens"]))
                t = client.post(server.url + "/tokenize", json={"content": text, "add_special": True})
                t.raise_for_status()
                same_split.append(list(t.json()["tokens"]) == ids)
            else:
                r = client.post(server.url + "/v1/completions", json={
                    "model": server.model, "prompt": ids, "max_tokens": new_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True})
                r.raise_for_status()
                tokens.append(list(r.json()["choices"][0]["token_ids"]))
                t = client.post(server.url + "/tokenize", json={"model": server.model, "prompt": text})
                same_split.append(t.status_code == 200 and list(t.json()["tokens"]) == ids)
    return tokens, same_split


def compare(ref: Reference, got: list[list[int]]) -> list[str]:
    """Per prompt: 'identical' or where the first difference is and HF's margin there."""
    lines = []
    for want, have, margins in zip(ref.tokens, got, ref.margins):
        if want == have:
            lines.append(f"identical ({len(want)})")
            continue
        pos = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        margin = f", HF top-1 margin there {margins[pos]:.4f}" if pos < len(margins) else ""
        lines.append(f"differs from token {pos} of {len(want)}{margin} (min margin before: "
                     f"{min(margins[:pos]) if pos else float('nan'):.4f})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--engines", default="twospeed,vllm,llama")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ok = True
    for dtype in args.dtypes.split(","):
        folder = model_dir(dtype)
        if not folder.is_dir():
            print(f"{folder} missing: run make_checkpoint.py", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        ref = hf_reference(folder, dtype, args.new_tokens)
        print(f"== {dtype}: HF reference in {time.monotonic() - t0:.0f} s; prompt lengths "
              f"{[len(p) for p in ref.prompt_ids]}; HF min margin per prompt "
              f"{[round(min(m), 4) for m in ref.margins]}", flush=True)
        for engine in args.engines.split(","):
            t0 = time.monotonic()
            split = None
            if engine == "twospeed":
                got = twospeed_tokens(folder, dtype, ref, args.new_tokens)
            else:
                got, split = server_tokens(engine, dtype, ref, args.new_tokens)
            verdicts = compare(ref, got)
            ok &= all(v.startswith("identical") for v in verdicts) and (split is None or all(split))
            print(f"{engine:9s} {dtype}: " + "; ".join(verdicts)
                  + (f"; tokenizer agrees with HF on {sum(split)}/{len(split)} prompts" if split is not None else "")
                  + f"  [{time.monotonic() - t0:.0f} s]", flush=True)
    print("ALL IDENTICAL" if ok else "SOME DIVERGENCE (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
