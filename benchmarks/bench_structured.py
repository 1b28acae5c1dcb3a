"""Tool calls with and without jump-forward: decode steps, forward passes and time per call.

Run:  .venv/bin/python benchmarks/bench_structured.py [--calls 24] [--device cpu|cuda] [--dtype auto|float32|bfloat16]
          [--out BENCHMARKS.md] [--no-write]

The model is the demo checkpoint (random weights, 8192-token BPE). Each call is a chat prompt (the
checkpoint's template with two tools rendered in) and tool_choice "required": the grammar is the server's
(twospeed/server/tool_calls.py tool_call_schema), compiled by llguidance. Greedy, so the two modes must emit
the same tokens (checked). Per mode:

  (a) one call at a time (the agent-loop case): engine steps (= forward passes) per call, decode steps
      (clock.decode_steps), forced tokens, output tokens, and wall time per call (p50, p90), from
      add_request to the finished output, each call's grammar already in the compile cache;
  (b) all calls together in one LLM.generate: wall time and engine steps for the batch.

Also printed: the grammar's compile time (first use, cache miss) and the cost of a mask (llguidance on
the CPU, mean over the run). Timings on a shared machine are noisy: the report says what the load was.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from twospeed import LLM, SamplingParams  # noqa: E402
from twospeed.engine.sampling_params import StructuredOutput  # noqa: E402
from twospeed.server.protocol import tool_call_schema  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"], "properties": {
    "city": {"type": "string", "maxLength": 16, "pattern": "^[A-Za-z ]+$"},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query", "limit", "filters"], "properties": {
    "query": {"type": "string", "maxLength": 24},
    "limit": {"type": "integer", "minimum": 1, "maximum": 50},
    "filters": {"type": "array", "maxItems": 3, "items": {"enum": ["news", "images", "video", "recent"]}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "web_search", "description": "search the web",
                                           "parameters": SEARCH}}]
QUESTIONS = ["What is the weather in Paris this week?", "Find recent news about solar power.",
             "Will it rain in Oslo tomorrow?", "Search for pictures of red pandas.",
             "How hot will Cairo be on Friday?", "Look up the latest results of the chess olympiad."]


def percentile(values: list[float], p: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_mode(llm: LLM, prompts: list[str], spec: StructuredOutput, max_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured=spec)
    rows = []
    for prompt in prompts:  # (a) one call at a time
        t0 = time.perf_counter()
        req = engine.add_request(None, prompt, params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"wall": time.perf_counter() - t0, "steps": steps, "decode_steps": req.clock.decode_steps,
                     "forced": req.bill.forced_tokens, "output": req.bill.output_tokens,
                     "tokens": list(req.output_token_ids), "finish": req.finish_reason,
                     "text": req.detokenizer.output_text if req.detokenizer else ""})
    t0 = time.perf_counter()  # (b) all together
    steps = 0
    reqs = [engine.add_request(None, p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    batch_wall = time.perf_counter() - t0
    assert [r.output_token_ids for r in reqs] == [row["tokens"] for row in rows], "batch != one at a time"
    return {"rows": rows, "batch_wall": batch_wall, "batch_steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=24, help="tool calls per mode")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="float32 by default: greedy token identity across code paths is exact there")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "BENCHMARKS.md")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--note", default="", help="a line about the machine's state, written with the results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    llm = LLM("demo", device=args.device, dtype=args.dtype)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"}],
                                       tools=TOOLS) for i in range(args.calls)]
    call = tool_call_schema({t["function"]["name"]: t["function"]["parameters"] for t in TOOLS})
    t0 = time.perf_counter()
    llm.engine.grammars.compile(StructuredOutput(json=call))
    compile_ms = (time.perf_counter() - t0) * 1e3
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    load_before = load_average()

    results = {}
    for jf in (False, True):
        results[jf] = run_mode(llm, prompts, StructuredOutput(json=call, jump_forward=jf), args.max_tokens)
    load_after = load_average()
    same = all(a["tokens"] == b["tokens"] for a, b in zip(results[False]["rows"], results[True]["rows"]))
    valid = sum(r["finish"] == "stop" and isinstance(json.loads(r["text"]), dict) for r in results[True]["rows"])

    # The cost of one mask, measured apart: llguidance on the CPU for this grammar, 200 fresh states.
    grammars = llm.engine.grammars
    t0 = time.perf_counter()
    for _ in range(200):
        grammars.new_state(StructuredOutput(json=call)).allowed()
    mask_us = (time.perf_counter() - t0) / 200 * 1e6

    def mean(key: str, jf: bool) -> float:
        return statistics.mean(r[key] for r in results[jf]["rows"])

    lines = [f"### Structured output: tool calls with and without jump-forward "
             f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"`.venv/bin/python benchmarks/bench_structured.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"demo model, {args.dtype}, device {args.device} "
                 f"({torch.cuda.get_device_name() if args.device.startswith('cuda') else platform.processor() or platform.machine()}), "
                 f"torch threads {args.threads}, {args.calls} greedy calls, tool_choice required over 2 tools; "
                 f"load average before {load_before}, after {load_after}." + (f" {args.note}" if args.note else ""),
             "", "| per call (one at a time) | no jump-forward | jump-forward |", "| --- | --- | --- |"]
    for label, key in (("output tokens", "output"), ("forced tokens", "forced"),
                       ("decode steps (clock.decode_steps)", "decode_steps"), ("engine steps = forward passes", "steps")):
        lines.append(f"| {label} | {mean(key, False):.1f} | {mean(key, True):.1f} |")
    for p in (50, 90):
        walls = {jf: [r["wall"] * 1e3 for r in results[jf]["rows"]] for jf in (False, True)}
        lines.append(f"| time per call p{p} (ms) | {percentile(walls[False], p):.1f} | {percentile(walls[True], p):.1f} |")
    lines += [f"| all {args.calls} calls in one batch: wall (ms) | {results[False]['batch_wall'] * 1e3:.0f} | "
              f"{results[True]['batch_wall'] * 1e3:.0f} |",
              f"| all {args.calls} calls in one batch: engine steps | {results[False]['batch_steps']} | "
              f"{results[True]['batch_steps']} |", "",
              f"Same tokens in both modes: {'yes' if same else 'NO'}; complete, parseable calls: {valid}/{args.calls}. "
              f"Grammar compile (first use): {compile_ms:.1f} ms; one mask (llguidance, CPU): {mask_us:.0f} us.", ""]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n" + report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
