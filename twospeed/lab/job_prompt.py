"""A job's prompt, turn by turn: the history an agent harness resends on every call.

Each call's prompt is the byte-stable prefix (system block + tool schemas), the job's task, every earlier turn
(its instruction, the model's answer, the tool results that followed, in call order), then this turn's
instruction. So a turn's prompt is the previous prompt plus the previous answer, its observations and a new
instruction: append-only, which is what lets a prefix cache serve everything but the new part.

Completions prompts are one text:

    {prefix}TASK: {task}
    STEP gather: {instruction}
    ASSISTANT:{answer}
    TOOL search RESULT: {observation}
    STEP act: {instruction}
    ASSISTANT:

Chat prompts are messages: system = the prefix, then user (task + first instruction), and per turn the
assistant's answer and one user message with the observations and the next instruction; rendered by a chat
template they are append-only too (the generation prompt is the start of the next assistant message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from twospeed.lab import prompts


@dataclass(slots=True)
class Observation:
    """One tool result as it enters the history."""

    tool: str
    text: str
    tokens: int  # tokens of `text` (after any summarizing)
    dump_tokens: int  # what the tool returned, before summarizing


@dataclass(slots=True)
class Turn:
    step: str
    instruction: str
    answer: str = ""
    observations: list[Observation] = field(default_factory=list)


def observation_block(observations: list[Observation]) -> str:
    """Parallel (or sequential) tool results concatenated in call order."""
    return "".join(f"TOOL {o.tool} RESULT: {o.text}\n" for o in observations)


class History:
    """The job's conversation so far; `prompt` renders the next call's prompt for the lane's endpoint."""

    def __init__(self, task: str, endpoint: str = "completions"):
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be completions or chat, got {endpoint!r}")
        self.task, self.endpoint = task, endpoint
        self.turns: list[Turn] = []

    def add(self, turn: Turn) -> None:
        self.turns.append(turn)

    def prompt(self, prefix: str, step: str, instruction: str) -> tuple[str | None, list[dict] | None]:
        """(text, None) for completions or (None, messages) for chat."""
        if self.endpoint == "chat":
            return None, self._messages(prefix, step, instruction)
        parts = [prefix, f"TASK: {self.task}\n"]
        for t in self.turns:
            parts.append(f"STEP {t.step}: {t.instruction}\nASSISTANT:{t.answer}\n{observation_block(t.observations)}")
        parts.append(f"STEP {step}: {instruction}\nASSISTANT:")
        return "".join(parts), None

    def _messages(self, prefix: str, step: str, instruction: str) -> list[dict]:
        messages = [{"role": "system", "content": prefix}]
        user = f"TASK: {self.task}\n"
        for t in self.turns:
            messages.append({"role": "user", "content": f"{user}STEP {t.step}: {t.instruction}"})
            messages.append({"role": "assistant", "content": t.answer})
            user = observation_block(t.observations)
        messages.append({"role": "user", "content": f"{user}STEP {step}: {instruction}"})
        return messages


def system_block(rng: np.random.Generator, counter: prompts.TokenCounter, tokens: int, tools: list[str]) -> str:
    """The job's byte-stable prefix: instructions, filler words up to `tokens`, and its own tools' schemas."""
    schemas = [{"name": t, "description": t.replace("_", " "),
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}
               for t in tools]
    head = "SYSTEM: You are a support agent. Work step by step; call one tool per step by name.\n"
    tail = f"TOOLS:\n{json.dumps(schemas)}\n"
    return head + prompts.words(rng, counter, max(0, tokens - counter.count(head + tail))) + "\n" + tail


def summary_prompt(observation: Observation, max_tokens: int) -> str:
    """The prompt of a `summarize: {by: model}` call: the dump alone, outside the job's history."""
    return (f"Summarize this {observation.tool} result in at most {max_tokens} tokens, keeping ids and numbers.\n"
            f"RESULT: {observation.text}\nSUMMARY:")
