"""Diagnosis: for every lane and job lane of a run, which speed hurt and which lever to pull, with the numbers.

`diagnose(doc)` reads each lane's facts (lane_facts.py: the measured split of the misses and of all
user-visible time into queue / prefill / decode / tool / gate, and the evidence beside it) and runs RULES, the
one table below. A rule names its lever, the part of the time it acts on, and a test that returns its
evidence or None. Levers that only save time need misses to act on (or a lane with no objective, where all
user-visible time counts); `waste` levers (tokens or cache thrown away) apply even when every objective was
met. Levers are ranked by the share of the problem time their part holds, ties in table order. A lane where
nothing fires says so. A failed request (or a job that ended on an error) is a miss: its errors lead the lane's
verdict with their class and count, and a lane with any is never called fine. `twospeed bench` prints the diagnosis; `twospeed diagnose RUN` reprints it.

The rule of thumb it encodes: first token slow and the prompt huge -> cut it, summarize it, keep its prefix
cached; first token fine and the stream crawls -> output length and stop rules, interference, or the memory
bandwidth of decode itself; waiting before either -> capacity; waiting on tools or gates -> not the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from twospeed.lab import errors as error_classes
from twospeed.lab.lane_facts import JOB_PARTS, Facts, lane_facts

# Thresholds (named so the table reads as prose)
SIGNIFICANT = 0.3  # a part holding this share of the problem time is worth a lever
LARGE_PROMPT = 1000  # prefilled tokens per call that make prefill worth cutting
MIN_DUMP = 256  # a tool result this long counts as a dump
DUMP_SHARE = 0.3  # dumps (less their summaries) making this share of the lane's prefilled tokens are worth summarizing
SUMMARY_TOKENS = 512  # what a summarized dump should be (at most; a quarter of a smaller dump)
UNSTABLE_SHARE = 0.25  # share of prompts diverging inside their shared prefix
CACHE_SHORTFALL = 0.5  # measured hit below this fraction of the predicted one: the server is not keeping it
LONG_ANSWERS = 0.5  # answers running to max_tokens
NEEDED_SHARE = 0.5  # the gate needed under this share of the output
INTERFERED = 0.5  # share of ITL misses that must be stalls (or slow steps) for their lever
REPEATS = 0.4  # output words a prompt-lookup draft would have guessed
SLOW_GATE = 0.2  # gate share of the problem time


@dataclass(frozen=True, slots=True)
class Rule:
    key: str
    lever: str  # what to do
    part: str  # the part of the time it acts on
    test: Callable[[Facts], str | None]  # the evidence when the rule applies
    waste: bool = False  # applies even when every objective was met


@dataclass(slots=True)
class Lever:
    key: str
    lever: str
    part: str
    share: float  # of the problem time (or, with no misses, of user-visible time)
    evidence: str


@dataclass(slots=True)
class Diagnosis:
    lane: str
    unit: str
    n: int
    missed: int
    misses_by: dict[str, int]  # objective -> misses (for a job lane: "window" jobs, and calls per call objective)
    objective: str
    problem: str
    split: dict[str, float]  # share of the problem time per part
    visible: dict[str, float]  # share of user-visible time per part
    dominant: str | None  # the part holding most of the problem time
    levers: list[Lever] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: int = 0  # units that failed (requests, or jobs that ended on an error)
    errors: int = 0  # calls that failed
    calls: int = 0
    errors_by_class: dict[str, int] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        split = ", ".join(f"{p} {s:.0%}" for p, s in sorted(self.visible.items(), key=lambda x: -x[1]) if s >= 0.005)
        split = split or "no successful request"
        failed = ""
        if self.errors or self.failed:
            calls = "calls" if self.unit == "jobs" else "requests"
            failed = f"{self.errors} of {self.calls} {calls} failed ({error_classes.text(self.errors_by_class)}); "
        if self.problem == "missed":
            unit = " calls" if self.unit == "jobs" else ""
            by = ", ".join(f"{k} {v}{'' if k in ('window', 'error') else unit}" for k, v in sorted(self.misses_by.items()))
            objective = f"{self.objective}; " if self.objective else ""
            head = f"{failed}{self.missed} of {self.n} {self.unit} missed ({objective}missed: {by})"
            if self.dominant is None or not self.split:
                return f"{head}. User-visible time: {split}."
            return (f"{head}; {self.dominant} dominates the timed misses ({self.split.get(self.dominant, 0):.0%} of "
                    f"their time). User-visible time: {split}.")
        if self.problem == "all":
            if self.dominant is None:
                return f"{failed}no objective set. User-visible time: {split}."
            return f"{failed}no objective set; {self.dominant} dominates user-visible time: {split}."
        if not self.levers:
            return (f"nothing to fix: all {self.n} {self.unit} met {self.objective or 'their objectives'} and no "
                    f"lever applies. User-visible time: {split}.")
        return f"all {self.n} {self.unit} met {self.objective}, but tokens are spent for nothing. User-visible: {split}."

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.0f} ms"


def _where(f: Facts) -> str:
    return "missed" if f.problem == "missed" else "user-visible"


# -- the rules' tests ---------------------------------------------------------------------------------
def summary_target(dumps: list[int]) -> int:
    """What to summarize dumps to: SUMMARY_TOKENS, or a quarter of the typical dump when that is smaller."""
    typical = sorted(dumps)[len(dumps) // 2]
    return max(32, min(SUMMARY_TOKENS, typical // 4 // 16 * 16))


def summarize_prediction(f: Facts) -> dict | None:
    """What summarizing the job lane's dumps would save: the target size, prefilled tokens per dump, and the
    TTFT drop on the turn after a dump at the measured prefill time per token (None when no dumps matter)."""
    results = [t for t in f.observations if t >= MIN_DUMP]
    if f.unit != "jobs" or not results:
        return None
    target = summary_target(results)
    dumps = [t for t in results if t > target]
    excess = sum(t - target for t in dumps)
    if not dumps or excess < DUMP_SHARE * f.prefilled_tokens * f.calls:
        return None
    per_dump = excess / len(dumps)
    return {"target_tokens": target, "dumps": len(dumps), "dump_tokens": sum(dumps) / len(dumps),
            "saved_tokens_per_dump": per_dump, "prefilled_share": excess / (f.prefilled_tokens * f.calls),
            "ttft_drop_s": per_dump * f.prefill_s_per_token if f.prefill_s_per_token else None}


def summarize_dumps(f: Facts) -> str | None:
    p = summarize_prediction(f)
    if p is None or f.share("prefill") < SIGNIFICANT:
        return None
    drop = (f" At the measured {f.prefill_s_per_token * 1e6:,.0f} µs per prefilled token that is ~"
            f"{_ms(p['ttft_drop_s'])} less TTFT on each turn after a dump." if p["ttft_drop_s"] is not None else "")
    policy = f" (the policy in force keeps {f.summarize['max_tokens']})" if f.summarize else ""
    return (f"prefill is {f.share('prefill'):.0%} of the {_where(f)} time; {p['dumps']} tool dumps entered the history "
            f"at {p['dump_tokens']:,.0f} tokens on average{policy}, {p['prefilled_share']:.0%} of all prefilled "
            f"tokens. Summarizing each to {p['target_tokens']} tokens (--summarize-dumps {p['target_tokens']}) "
            f"prefills {p['saved_tokens_per_dump']:,.0f} fewer tokens per dump.{drop}")


def cut_prompt(f: Facts) -> str | None:
    if f.share("prefill") < SIGNIFICANT or f.problem_tokens[1] < LARGE_PROMPT:
        return None
    if summarize_dumps(f):
        return None  # the dumps explain it: summarize_dumps says so
    prompt, prefilled = f.problem_tokens
    half = f" Halving the new part saves ~{_ms(prefilled / 2 * f.prefill_s_per_token)} of TTFT per call." \
        if f.prefill_s_per_token else ""
    return (f"prefill is {f.share('prefill'):.0%} of the {_where(f)} time; their prompts average {prompt:,.0f} tokens, "
            f"{prefilled:,.0f} of them prefilled.{half}")


def stabilize_prefix(f: Facts) -> str | None:
    p = f.prefix
    if not p or p["declared_prefix_prompts"] < 2:
        return None
    if p["unstable_prompts"] < max(1, UNSTABLE_SHARE * p["declared_prefix_prompts"]):
        return None
    u = p["first_unstable"]
    span = f"…{u['context']}[{u['before']}] → [{u['after']}]"
    return (f"{p['unstable_prompts']} of {p['declared_prefix_prompts']} prompts that share the lane's "
            f"{f.prefix_tokens:,}-token prefix already differ inside it; cache hit {(f.cached_share or 0):.0%} "
            f"(prefix-score predicts {p['predicted_hit_rate']:.0%}). First unstable span, char {u['char_offset']} of "
            f"prompt {u['prompt']}: {span!r}. Move what changes (times, ids, reordered lists) after the prefix.")


def keep_prefix_cached(f: Facts) -> str | None:
    p = f.prefix
    if not p or not f.cache_reported or p["predicted_hit_rate"] < 0.2 or (p["unstable_prompts"] and stabilize_prefix(f)):
        return None
    measured = f.cached_share or 0.0
    if measured >= CACHE_SHORTFALL * p["predicted_hit_rate"]:
        return None
    return (f"prefix-score predicts {p['predicted_hit_rate']:.0%} of this lane's prompt tokens cached, the server "
            f"served {measured:.0%}: the prompts are stable but the server is not keeping them (prefix caching off, "
            f"evicted for lack of KV memory, or routed to another replica).")


def stop_on_schema(f: Facts) -> str | None:
    if f.answers < 3:
        return None
    ran_long = not f.ignore_eos and f.length_share is not None and f.length_share >= LONG_ANSWERS
    wasted = f.needed_share is not None and f.needed_share < NEEDED_SHARE
    if not (ran_long or wasted):
        return None
    parts = []
    if ran_long:
        parts.append(f"{f.length_share:.0%} of answers ran to max_tokens ({f.max_tokens:,.0f})")
    if f.needed_share is not None:
        parts.append(f"the gate's JSON was complete after {f.needed_tokens:,.0f} of {f.output_tokens:,.0f} tokens "
                     f"on average ({f.needed_share:.0%})")
    return "; ".join(parts) + "; decode is " + f"{f.share('decode', 'visible'):.0%} of user-visible time."


def chunk_budget(f: Facts) -> str | None:
    if f.itl_misses == 0 or f.itl_blamed < INTERFERED * f.itl_misses:
        return None
    share = (f" ({f.interfered_share:.0%} of this lane's decode steps shared the batch with a prefill chunk)"
             if f.interfered_share else "")
    if f.itl_interfered:
        cause = f"{f.itl_interfered} came with at least as many interfered steps as slow gaps{share}"
    else:
        cause = ("no slow gap shared its step with a prefill chunk, so other requests' prefills ran whole between "
                 "the decode steps (chunked prefill off?)")
    return (f"{f.itl_blamed} of {f.itl_misses} ITL misses are other work in their steps: {f.itl_stalls} are stalls "
            f"(typical gap {_ms(f.itl_missed_p50)} against the {_ms(f.itl_objective_s)} objective, gaps up to "
            f"{_ms(f.itl_missed_max)}), {cause}. Chunked prefill with a smaller chunk budget (--max-num-batched-tokens) "
            f"or a prefill cap beside decodes keeps every step short.")


def bandwidth_bound(f: Facts) -> str | None:
    slow = f.itl_misses - f.itl_blamed
    if f.itl_misses == 0 or slow < INTERFERED * f.itl_misses or f.itl_unknown == f.itl_misses:
        return None
    return (f"{slow} of {f.itl_misses} ITL misses are slow steps with no prefill beside them (typical gap "
            f"{_ms(f.itl_missed_p50)} against the {_ms(f.itl_objective_s)} objective). Each decode step reads every "
            f"weight and the whole KV cache: fewer bytes (quantize, judged by `twospeed gate`) or more replicas for "
            f"smaller batches.")


def add_capacity(f: Facts) -> str | None:
    if f.share("queue") < SIGNIFICANT:
        return None
    return (f"queue is {f.share('queue'):.0%} of the {_where(f)} time (p90 {_ms(f.queue_p90)}): requests wait for a "
            f"slot before any compute.")


def speculation(f: Facts) -> str | None:
    if f.share("decode") < 0.5 or f.repeat_share is None or f.repeat_share < REPEATS:
        return None
    return (f"decode is {f.share('decode'):.0%} of the {_where(f)} time and {f.repeat_share:.0%} of output words "
            f"repeat a trigram already in the prompt or answer (templated output a prompt-lookup draft would guess).")


def slow_tools(f: Facts) -> str | None:
    if f.unit != "jobs" or f.share("tool") < SIGNIFICANT:
        return None
    per_job = f.visible.get("tool", 0.0) / max(1, f.n)
    return (f"tool round trips are {f.share('tool'):.0%} of the {_where(f)} time ({per_job:,.1f} s per job): the "
            f"model is not the bottleneck here.")


def slow_gate(f: Facts) -> str | None:
    if f.unit != "jobs" or f.share("gate") < SLOW_GATE:
        return None
    per_job = f.visible.get("gate", 0.0) / max(1, f.n)
    return f"judging answers is {f.share('gate'):.0%} of the {_where(f)} time ({per_job:,.2f} s per job): a slow gate, not a slow decode."


RULES: tuple[Rule, ...] = (
    Rule("summarize_dumps", "summarize the tool dumps before they enter the history", "prefill", summarize_dumps),
    Rule("cut_prompt", "cut or pack the prompt (fewer passages, a shorter history)", "prefill", cut_prompt),
    Rule("stabilize_prefix", "stabilize the prefix", "prefill", stabilize_prefix, waste=True),
    Rule("keep_prefix_cached", "keep the prefix cached on the server", "prefill", keep_prefix_cached, waste=True),
    Rule("stop_on_schema", "stop on schema (response_format) or lower max_tokens", "decode", stop_on_schema, waste=True),
    Rule("chunk_budget", "lower the chunk budget / set a step-time target", "decode", chunk_budget),
    Rule("quantize_or_capacity", "quantize behind the gate, or add capacity", "decode", bandwidth_bound),
    Rule("add_capacity", "add capacity (replicas) or admit less", "queue", add_capacity),
    Rule("speculation", "speculate (n-gram prompt lookup or a draft model)", "decode", speculation),
    Rule("speed_up_tools", "call tools in parallel, cache or speed them up", "tool", slow_tools),
    Rule("speed_up_gate", "speed up the gate (a cheaper check, or judge while the next step runs)", "gate", slow_gate),
)


def _notes(f: Facts) -> list[str]:
    notes = []
    for c, n in f.errors_by_class.items():
        first = f.first_errors.get(c, "")
        notes.append(f"{n} {c}: {error_classes.HINTS.get(c, error_classes.HINTS['other'])}. First: {first[:200]!r}")
    if f.gate_rate is not None and f.gate_rate < 0.5 and f.answers:
        notes.append(f"only {f.gate_rate:.0%} of answers passed the gate: goodput is lost to quality, not speed.")
    if f.clock == "llama.cpp timings":
        notes.append("prefill and decode from llama.cpp's timings per request; queue is the client's TTFT less the "
                     "server's prompt_ms (the wait for a slot, and the HTTP hop).")
    elif f.clock.startswith("vLLM"):
        notes.append("queue and prefill from vLLM's /metrics histograms over this run (the run's only lane), "
                     "apportioned over the lane's requests by their share: not per request.")
    elif not f.server_clock and f.answers:
        mixed = (f" (the server's /metrics clock covers the run's {f.run_clock_lanes} lanes together: run this lane "
                 f"alone to split its queue)" if f.run_clock_lanes > 1 else "")
        notes.append(f"no server clock: queue is not measured, so TTFT counts as prefill{mixed}.")
    if f.ignore_eos:
        notes.append("the run forced every answer to max_tokens (--ignore-eos): answer length is the workload's.")
    return notes


def diagnose_lane(f: Facts) -> Diagnosis:
    parts = JOB_PARTS if f.unit == "jobs" else ("queue", "prefill", "decode")
    total = sum(f.time.values())
    split = {p: f.time.get(p, 0.0) / total for p in parts} if total > 0 else {}
    vis_total = sum(f.visible.values())
    visible = {p: f.visible.get(p, 0.0) / vis_total for p in parts} if vis_total > 0 else {}
    d = Diagnosis(f.lane, f.unit, f.n, f.missed, dict(f.misses_by), f.objective, f.problem, split, visible,
                  max(split, key=split.get) if split else (max(visible, key=visible.get) if visible else None),
                  failed=f.failed_units, errors=f.errors, calls=f.calls, errors_by_class=dict(f.errors_by_class))
    ranked = []
    for order, rule in enumerate(RULES):
        if f.problem == "none" and not rule.waste:
            continue
        evidence = rule.test(f)
        if evidence:
            share = split.get(rule.part, 0.0) if split else visible.get(rule.part, 0.0)
            ranked.append((-share, order, Lever(rule.key, rule.lever, rule.part, share, evidence)))
    d.levers = [lever for _, _, lever in sorted(ranked, key=lambda x: x[:2])]
    d.notes = _notes(f)
    return d


def diagnose(doc: dict) -> list[Diagnosis]:
    """One Diagnosis per lane of a results.json document."""
    return [diagnose_lane(lane_facts(doc, lane)) for lane in doc["lanes"]]


def print_diagnosis(docs_or_diagnoses, console, title: str | None = None) -> None:
    """Print the diagnosis of each lane (from Diagnosis objects, or computed from a results.json document)."""
    from rich.markup import escape

    diagnoses = diagnose(docs_or_diagnoses) if isinstance(docs_or_diagnoses, dict) else docs_or_diagnoses
    console.print(f"[bold]diagnosis{escape(' of ' + title) if title else ''}[/bold]")
    for line in diagnosis_lines(diagnoses):
        console.print(escape(line), highlight=False)


def diagnosis_lines(diagnoses: list[Diagnosis]) -> list[str]:
    """The diagnosis as plain text lines (console, report.html)."""
    lines = []
    for d in diagnoses:
        lines.append(f"{d.lane} ({d.unit}): {d.verdict}")
        for i, lever in enumerate(d.levers, 1):
            lines.append(f"  {i}. {lever.lever} [{lever.part}, {lever.share:.0%}]: {lever.evidence}")
        lines += [f"  note: {note}" for note in d.notes]
    return lines
