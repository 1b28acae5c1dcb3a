"""Task prompts: a lane's prompts drawn from the task corpus (builtin/task_corpus.py) instead of word salad.

A lane with `prompts: task` (or `twospeed bench --prompts task`) keeps its shape — arrivals, lengths, the
byte-stable shared prefix, max_tokens, SLO, gate — but its prompts are the corpus' formats, which the
built-in `demo-task` model has learnt. So against that model the gates mean something: the rag lane's
citations point at the passage that holds the answer, the agent lane's tool calls copy the evidence's id,
and a quantized or otherwise damaged model shows as a lower pass rate.

Same interface as lab/prompts.py (`shared_prefix`, `BUILDERS`), so the planner picks one or the other per
lane. The lab's numpy generator seeds a `random.Random` per prompt (the corpus' generator): seeds the
training never drew. A chat lane's task prompts carry a system block that forbids one topic, and
`REFUSAL_SHARE` of them ask for exactly that: their meta says a refusal is expected, and the lane's
refusal gate follows the meta.

`judge(example, text)` runs the gates a lane's answer must pass (the same gate functions the lab uses), for
the task model's tests and benchmark.
"""

from __future__ import annotations

import random

import numpy as np

from twospeed.builtin import task_corpus
from twospeed.lab import gates
from twospeed.lab.prompts import Prompt, TokenCounter

REFUSAL_SHARE = 0.2  # of a chat lane's task prompts, those that ask for what the system block forbids

# The built-in workloads' schemas (agent.yaml, nightly.yaml), which the corpus' answers follow.
TOOL_CALL_SCHEMA = {
    "type": "object", "required": ["tool", "arguments"], "additionalProperties": False,
    "properties": {"tool": {"enum": list(task_corpus.TOOLS)},
                   "arguments": {"type": "object", "required": ["id"], "additionalProperties": False,
                                 "properties": {"id": {"type": "string", "maxLength": 12},
                                                "note": {"type": "string", "maxLength": 40}}}}}
MAPPING_SCHEMA = {
    "type": "object", "required": ["code", "confidence"], "additionalProperties": False,
    "properties": {"code": {"enum": list(task_corpus.CODES)},
                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}


def _random(rng: np.random.Generator) -> random.Random:
    return random.Random(int(rng.integers(2 ** 63)))


def _sized(build, r: random.Random, counter: TokenCounter, tokens: int) -> str:
    """A prefix of about `tokens` tokens: its fixed part (system line, schemas, rules) plus filler words."""
    state = r.getstate()
    fixed = counter.count(build(r, 0))
    r.setstate(state)
    return build(r, counter.words_for(tokens - fixed) if tokens > fixed else 0)


def shared_prefix(kind: str, rng: np.random.Generator, counter: TokenCounter, tokens: int) -> str:
    """A lane's byte-stable prefix in the corpus' format ("" when the lane has none)."""
    if tokens <= 0 or kind == "rag":
        return ""
    r = _random(rng)
    build = {"agent": task_corpus.agent_prefix, "nightly": task_corpus.nightly_prefix,
             "chat": task_corpus.support_prefix}[kind]
    return _sized(build, r, counter, tokens)


def _prompt(example: task_corpus.TaskExample) -> Prompt:
    return Prompt(example.prompt, {**example.meta, "task_lane": example.lane})


def agent(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    r = _random(rng)
    if "TOOLS:\n" not in prefix:  # no shared prefix (prefix_tokens 0, or only the run's salt)
        prefix += task_corpus.agent_prefix(r, 0)
    return _prompt(task_corpus.agent(r, prefix, counter.words_for(new_tokens), turn))


def rag(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    return _prompt(task_corpus.rag(_random(rng), prefix, counter.words_for(new_tokens), turn))


def nightly(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    r = _random(rng)
    if "Map each row" not in prefix:
        prefix += task_corpus.nightly_prefix(r, 0)
    return _prompt(task_corpus.nightly(r, prefix, counter.words_for(new_tokens), turn))


def chat(rng, counter, prefix: str, new_tokens: int, turn: int) -> Prompt:
    r = _random(rng)
    build = task_corpus.refusal if r.random() < REFUSAL_SHARE else task_corpus.chat
    return _prompt(build(r, prefix, counter.words_for(new_tokens), turn))


BUILDERS = {"agent": agent, "rag": rag, "chat": chat, "nightly": nightly}


# -- judging an answer ----------------------------------------------------------------------------------
def lane_gates(lane: str) -> dict[str, dict]:
    """The gates (name -> gate config) an answer to a corpus lane must pass."""
    if lane == "agent":
        return {"json": {"type": "json"}, "json_schema": {"type": "json_schema", "schema": TOOL_CALL_SCHEMA}}
    if lane == "rag":
        return {"citation": {"type": "citation", "min_citations": 1}}
    if lane == "nightly":
        return {"json": {"type": "json"}, "allowed_codes": {"type": "allowed_codes", "field": "code"},
                "json_schema": {"type": "json_schema", "schema": MAPPING_SCHEMA}}
    return {"refusal": {"type": "refusal"}}  # refusal and chat: the request's meta says which is expected


def judge(example: task_corpus.TaskExample, text: str) -> dict[str, bool]:
    """Each gate's verdict on `text`, plus `correct`: the answer's content is the right one (the tool and id,
    the cited passage, the code), which the gates alone do not check."""
    verdicts = {name: gates.run_gate(cfg, text, example.meta).passed for name, cfg in lane_gates(example.lane).items()}
    meta = example.meta
    if example.lane == "rag":
        verdicts["correct"] = f"[{meta['expected_id']}]" in text
    elif example.lane in ("agent", "nightly"):
        try:
            verdicts["correct"] = gates.parse_json(text) == meta["expected"]
        except ValueError:
            verdicts["correct"] = False
    else:
        verdicts["correct"] = verdicts["refusal"]
    return verdicts
