"""The toy two-clocks model: why a long prompt costs TTFT and a long answer costs time per token.

Prefill of n prompt tokens costs a*n^2 + b*n: b for pushing each token through the weights,
a for attention, where every token looks at every earlier one. Decode emits one token per
step; step k costs `step` (reading every weight once) plus `per_cached_token` for each token
already in the KV cache (reading its K and V). So prefill grows with the prompt squared, and
each decode step grows with the context: two clocks, with two different cost drivers.

The defaults are roughly an 8B Llama in bf16 on one H100 SXM (NVIDIA datasheet: 989 TFLOP/s
dense bf16, 3.35 TB/s), at half the FLOP/s peak and the full bandwidth:
  b    = 2 FLOP x 8e9 params / 495e12 FLOP/s               = 3.2e-5 s per prompt token
  a    = (4 x 32 layers x 4096 q-dim / 2 causal) / 495e12  = 5.3e-10 s per token^2
  step = 16e9 weight bytes / 3.35e12 B/s                   = 4.8e-3 s per decode step
  per_cached_token = 131072 KV bytes / 3.35e12 B/s          = 3.9e-8 s per cached token per step
`twospeed clock --model ... --hardware ...` gives the real roofline numbers instead.

Standard library only, on purpose: this file runs on a laptop without torch
(`python clock.py 512:128 8000:50`) and is meant to be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ToyClock:
    """Cost coefficients, in seconds."""

    a: float = 5.3e-10  # prefill, per prompt token squared (attention)
    b: float = 3.2e-5  # prefill, per prompt token (weights)
    step: float = 4.8e-3  # decode, per step (reading the weights)
    per_cached_token: float = 3.9e-8  # decode, per token in the KV cache, per step (reading K and V)

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.step, self.per_cached_token) < 0:
            raise ValueError("toy clock coefficients must be >= 0")

    def prefill_time(self, prompt_tokens: int) -> float:
        """Seconds to prefill the prompt: the floor of TTFT."""
        n = prompt_tokens
        return self.a * n * n + self.b * n

    def step_time(self, cached_tokens: int) -> float:
        """Seconds of one decode step with `cached_tokens` in the KV cache: one inter-token gap."""
        return self.step + self.per_cached_token * cached_tokens

    def decode_time(self, prompt_tokens: int, output_tokens: int) -> float:
        """Seconds of the output_tokens - 1 decode steps after the first token (which prefill emits).
        Step k (1..m-1) has prompt + k cached tokens; the sum is in closed form."""
        steps = max(0, output_tokens - 1)
        cached = steps * prompt_tokens + steps * (steps + 1) // 2
        return steps * self.step + self.per_cached_token * cached

    def case(self, prompt_tokens: int, output_tokens: int) -> ClockCase:
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(f"prompt and output lengths must be >= 1, got {prompt_tokens}:{output_tokens}")
        prefill = self.prefill_time(prompt_tokens)
        decode = self.decode_time(prompt_tokens, output_tokens)
        steps = output_tokens - 1
        return ClockCase(prompt_tokens, output_tokens, prefill, decode, decode / steps if steps else 0.0,
                         self.step_time(prompt_tokens + steps) if steps else 0.0, prefill + decode)


@dataclass(frozen=True, slots=True)
class ClockCase:
    """One request shape through the toy clock; seconds."""

    prompt_tokens: int
    output_tokens: int
    prefill_s: float  # ~ TTFT
    decode_s: float  # ~ TTLT - TTFT
    itl_mean_s: float  # decode_s / (output_tokens - 1)
    itl_last_s: float  # the last gap: the longest, the cache is fullest
    total_s: float

    @property
    def decode_share(self) -> float:
        return self.decode_s / self.total_s if self.total_s else 0.0


DEFAULT_CASES = ((128, 512), (2000, 200), (8000, 50), (32000, 20), (500, 2000))


def parse_case(text: str) -> tuple[int, int]:
    """'PROMPT:OUTPUT' (token counts), e.g. '8000:50'."""
    try:
        prompt, output = (int(x) for x in text.replace("x", ":").split(":"))
    except ValueError:
        raise ValueError(f"a case is PROMPT:OUTPUT token counts, e.g. 8000:50; got {text!r}") from None
    if prompt < 1 or output < 1:
        raise ValueError(f"prompt and output lengths must be >= 1, got {text!r}")
    return prompt, output


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def format_table(cases: list[ClockCase]) -> str:
    header = ("prompt", "output", "prefill (~TTFT)", "decode", "ITL mean", "ITL last", "decode share")
    rows = [(f"{c.prompt_tokens:,}", f"{c.output_tokens:,}", _seconds(c.prefill_s), _seconds(c.decode_s),
             _seconds(c.itl_mean_s), _seconds(c.itl_last_s), f"{c.decode_share:.0%}") for c in cases]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def add_toy_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the toy clock (shared with `twospeed clock`)."""
    d = ToyClock()
    parser.add_argument("cases", nargs="*", metavar="PROMPT:OUTPUT",
                        help=f"token counts per case (default: {' '.join(f'{p}:{o}' for p, o in DEFAULT_CASES)})")
    parser.add_argument("--a", type=float, default=d.a, help="toy: prefill seconds per prompt token squared")
    parser.add_argument("--b", type=float, default=d.b, help="toy: prefill seconds per prompt token")
    parser.add_argument("--step", type=float, default=d.step, help="toy: decode seconds per step (weight read)")
    parser.add_argument("--per-cached-token", type=float, default=d.per_cached_token,
                        help="toy: decode seconds per cached token per step (KV read)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_toy(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    try:
        clock = ToyClock(args.a, args.b, args.step, args.per_cached_token)
        shapes = [parse_case(c) for c in args.cases] or list(DEFAULT_CASES)
        cases = [clock.case(p, o) for p, o in shapes]
    except ValueError as e:
        print(f"twospeed clock: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": "toy", "coefficients": asdict(clock),
                          "cases": [{**asdict(c), "decode_share": c.decode_share} for c in cases]}, indent=2), file=out)
        return 0
    print(f"toy two-clocks model: prefill = {clock.a:g}*n^2 + {clock.b:g}*n s; "
          f"decode step = {clock.step:g} + {clock.per_cached_token:g}*cached s", file=out)
    print(format_table(cases), file=out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the toy two-clocks model (standard library only)")
    add_toy_args(parser)
    sys.exit(run_toy(parser.parse_args()))
