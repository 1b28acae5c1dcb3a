"""Fitting a workload to the server's context before anything is sent.

A request fits when its prompt and its max_tokens together stay within the context the server states (vLLM
refuses it with a 400 otherwise, llama.cpp refuses the prompt or cuts the answer short). The lab reads that
length (server_kind.probe) and checks each lane's longest request as the workload draws it:

- it fits: nothing changes;
- only its tail is over (the lane's typical prompt fits): `capped`: each prompt is cut to the context less its
  own max_tokens, so the lane keeps its shape below the cap;
- its typical prompt is over too: `scaled`: the lane's prompt lengths (shared prefix and new part; a job's task,
  instructions and tool dumps) shrink by one factor until its longest request fits, so its shape is kept;
- `--strict-lengths`: the run is refused instead, naming each lane and the numbers.

Without the target's tokenizer the lab's token counts are estimates, so a share of the context (MARGIN) stays
free for the error. Traces are capped per prompt (their text is the user's; there is nothing to scale).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from twospeed.lab.job_spec import JobSpec, Summarize
from twospeed.lab.workload import Dist, Lane, Workload

MARGIN = 0.1  # share of the context left free when token counts are estimates (no --tokenizer)
TURN_OVERHEAD = 24  # a job turn's template tokens beyond its text (STEP/ASSISTANT lines, chat roles)
OBSERVATION_OVERHEAD = 8  # "TOOL x RESULT:" around each tool result
JOB_OVERHEAD = 32  # a job prompt's fixed template tokens (TASK line, chat wrapper)
SUMMARY_OVERHEAD = 40  # the summarizing call's instruction around the dump
RESERVE = 1  # a token kept free of every request: llama.cpp stops an answer one token before its context is full


@dataclass(slots=True)
class LaneFit:
    """What fitting did to one lane."""

    lane: str
    action: str  # "fits" | "capped" | "scaled" | "refused"
    prompt_max: int  # the lane's longest prompt as drawn before fitting (a job: its longest history), tokens
    output_max: int  # its largest max_tokens
    scale: float  # the lane's prompt scale after fitting
    prompt_max_after: int  # the longest prompt after fitting
    note: str = ""


@dataclass(slots=True)
class Fit:
    """The run's fitting: the context, where it was stated, the margin kept, and each lane's LaneFit."""

    context_length: int | None
    source: str
    margin: int = 0  # tokens kept free of every request (estimated counts)
    lanes: dict[str, LaneFit] = field(default_factory=dict)
    trace_capped: int = 0  # trace prompts cut to fit
    strict: bool = False

    def scale(self, lane: str, default: float) -> float:
        f = self.lanes.get(lane)
        return f.scale if f is not None else default

    def limit(self, max_tokens: int) -> int | None:
        """The longest prompt a request with this max_tokens may send (None: no context known)."""
        if self.context_length is None:
            return None
        return self.context_length - self.margin - RESERVE - max_tokens

    def changed(self) -> list[LaneFit]:
        return [f for f in self.lanes.values() if f.action != "fits"]

    def lines(self) -> list[str]:
        """What the run changed, for the console before the run starts."""
        if self.context_length is None:
            return ["fit: the server states no context length; prompts go as drawn (give --max-model-len to fit "
                    "them to it)"]
        margin = f", {self.margin:,} tokens kept free (token counts are estimates without --tokenizer)" \
            if self.margin else ""
        head = f"fit: {self.context_length:,}-token context ({self.source}){margin}"
        changed = self.changed()
        if not changed and not self.trace_capped:
            return [f"{head}: every request fits as drawn"]
        lines = [f"{head}:"]
        lines += [f"  lane {f.lane}: {f.note}" for f in changed]
        if self.trace_capped:
            lines.append(f"  trace: {self.trace_capped} prompts cut to the context less their max_tokens")
        return lines

    def as_dict(self) -> dict:
        return {"context_length": self.context_length, "source": self.source, "margin": self.margin,
                "strict": self.strict, "trace_capped": self.trace_capped,
                "lanes": {k: asdict(v) for k, v in self.lanes.items()}}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Fit | None":
        """A saved run's fitting (results.json run.fit), to rebuild the very prompts it sent."""
        if not d:
            return None
        return cls(d["context_length"], d["source"], d.get("margin", 0),
                   {k: LaneFit(**v) for k, v in (d.get("lanes") or {}).items()}, d.get("trace_capped", 0),
                   d.get("strict", False))


def _typical(d: Dist) -> float:
    if d.kind == "fixed" or d.min == d.max:
        return float(d.min)
    if d.kind == "lognormal" and d.median is not None:
        return float(min(max(d.median, d.min), d.max))
    return (d.min + d.max) / 2


def _outputs(d: Dist, cap: int | None) -> int:
    return min(d.max, cap) if cap else d.max


def request_prompt(lane: Lane, scale: float, which: str = "max", cap: int | None = None) -> int:
    """A request lane's prompt tokens at `scale` (as the planner draws them): its longest, shortest or typical."""
    d = lane.prompt_tokens
    new = d.max if which == "max" else d.min if which == "min" else _typical(d)
    n = round(lane.prefix_tokens * scale) + max(1, round(new * scale))
    return min(n, cap) if cap else n


def job_history(spec: JobSpec, prefix_tokens: int, scale: float, summarize: Summarize | None,
                output_cap: int | None) -> tuple[int, int]:
    """A job's longest prompt at `scale` (its whole history before the last call, every step repeated to its
    most and every draw at its largest) and the largest prompt a summarizing call sends. Overheads are generous:
    a bound, not an estimate."""
    def scaled(d: Dist) -> int:
        return max(1, round(d.max * scale))

    def observation(tool: str) -> int:
        dump = scaled(spec.tools[tool].observation_tokens)
        if summarize is not None and dump > summarize.max_tokens:
            dump = summarize.max_tokens
        return dump + OBSERVATION_OVERHEAD

    total = round(prefix_tokens * scale) + scaled(spec.task_tokens) + JOB_OVERHEAD
    summary = 0
    for step in spec.steps:
        repeat = step.repeat.max if step.repeat is not None else 1
        turn = scaled(step.prompt_tokens) + _outputs(step.max_tokens, output_cap) + TURN_OVERHEAD
        turn += sum(observation(t) for t in step.tools)
        total += repeat * turn
        if summarize is not None and summarize.by == "model":
            summary = max([summary] + [scaled(spec.tools[t].observation_tokens) + SUMMARY_OVERHEAD + summarize.max_tokens
                                       for t in step.tools])
    return total, summary


def _largest_scale(fits, scale: float) -> float | None:
    """The largest s <= scale with fits(s), to 1/1000 (None when not even a tiny scale fits)."""
    if fits(scale):
        return scale
    hi = scale
    if not fits(1e-3 * scale):
        return None
    lo = 1e-3 * scale
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return math.floor(lo * 1000) / 1000 if math.floor(lo * 1000) > 0 else lo


def fit_lane(lane: Lane, scale: float, limit, summarize: Summarize | None = None, prompt_cap: int | None = None,
             output_cap: int | None = None) -> LaneFit:
    """One lane against `limit(max_tokens)` (the longest prompt a request with that output may send)."""
    if lane.job is not None:
        out = max(_outputs(s.max_tokens, output_cap) for s in lane.job.steps)
        hist, summary = job_history(lane.job, lane.prefix_tokens, scale, summarize, output_cap)
        summary_out = summarize.max_tokens if summarize is not None and summarize.by == "model" else 0

        def fits(s: float) -> bool:
            h, sm = job_history(lane.job, lane.prefix_tokens, s, summarize, output_cap)
            return h <= limit(out) and (not sm or sm - summary_out <= limit(summary_out))

        if fits(scale):
            return LaneFit(lane.name, "fits", hist, out, scale, hist)
        s = _largest_scale(fits, scale)
        if s is None:
            return LaneFit(lane.name, "refused", hist, out, scale, hist,
                           f"a job's history can reach {hist:,} tokens and no prompt scale fits it: its answers alone "
                           f"are over the context (lower --max-output-tokens)")
        after = job_history(lane.job, lane.prefix_tokens, s, summarize, output_cap)[0]
        return LaneFit(lane.name, "scaled", hist, out, s, after,
                       f"a job's history can reach {hist:,} tokens + {out} output; prompt lengths (prefix, task, "
                       f"instructions, tool dumps) scaled {s / scale:.3g}x to keep it within {after:,}")
    out = _outputs(lane.max_tokens, output_cap)
    longest = request_prompt(lane, scale, "max", prompt_cap)
    if longest <= limit(out):
        return LaneFit(lane.name, "fits", longest, out, scale, longest)
    typical = request_prompt(lane, scale, "typical", prompt_cap)
    fixed = round(lane.prefix_tokens * scale) + max(1, round(lane.prompt_tokens.min * scale))
    if typical <= limit(out) and fixed <= limit(out):
        return LaneFit(lane.name, "capped", longest, out, scale, limit(out),
                       f"prompts up to {longest:,} tokens + up to {out} output; its typical {typical:,}-token prompt "
                       f"fits, so each prompt is capped at the context less its own max_tokens (at most "
                       f"{limit(lane.max_tokens.min):,})")
    s = _largest_scale(lambda s: request_prompt(lane, s, "max", prompt_cap) <= limit(out), scale)
    if s is None:
        return LaneFit(lane.name, "refused", longest, out, scale, longest,
                       f"its max_tokens ({out}) alone leaves no room for a prompt (lower --max-output-tokens)")
    after = request_prompt(lane, s, "max", prompt_cap)
    lo = request_prompt(lane, s, "min", prompt_cap)
    return LaneFit(lane.name, "scaled", longest, out, s, after,
                   f"prompts up to {longest:,} tokens + up to {out} output (typical {typical:,}); prompt lengths "
                   f"scaled {s / scale:.3g}x to {lo:,}-{after:,} tokens")


def fit_workload(workload: Workload, context_length: int | None, source: str, scale: float, exact: bool,
                 strict: bool = False, summarize=None, prompt_cap: int | None = None,
                 output_cap: int | None = None, trace_prompts=None) -> Fit:
    """Every lane fitted to `context_length` (None: nothing to fit). `summarize(lane)` gives a job lane's dump
    policy; `trace_prompts()` yields (prompt tokens, max_tokens) of a trace's requests. Raises ValueError naming
    the lanes that do not fit under --strict-lengths, or that cannot be made to fit."""
    fit = Fit(context_length, source, strict=strict)
    if context_length is None:
        return fit
    fit.margin = 0 if exact else math.ceil(MARGIN * context_length)
    if workload.trace is not None:
        over = [(n, m) for n, m in (trace_prompts() if trace_prompts else []) if n > fit.limit(m)]
        if over and strict:
            raise ValueError(f"--strict-lengths: {len(over)} trace prompts do not fit the {context_length:,}-token "
                             f"context ({source}) with their max_tokens (the longest: {max(n for n, _ in over):,} "
                             f"tokens)")
        fit.trace_capped = len(over)
        return fit
    for lane in workload.lanes:
        fit.lanes[lane.name] = fit_lane(lane, scale, fit.limit, summarize(lane) if summarize else None, prompt_cap,
                                        output_cap)
    bad = [f for f in fit.lanes.values() if f.action == "refused" or (strict and f.action != "fits")]
    if bad:
        what = "--strict-lengths: " if strict else ""
        raise ValueError(what + "; ".join(
            f"lane {f.lane}: prompts up to {f.prompt_max:,} tokens + {f.output_max} output do not fit the "
            f"{context_length:,}-token context ({source})" + (f": {f.note}" if f.action == "refused" else "")
            for f in bad) + ("" if not strict else "; drop --strict-lengths to let the lab scale or cap them, or "
                                                  "lower --scale / --max-prompt-tokens"))
    return fit
