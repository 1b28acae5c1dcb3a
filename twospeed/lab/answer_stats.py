"""What an answer says about its own decode, for the diagnosis: how many of its tokens the gate needed, and
how much of it a prompt-lookup draft could have guessed.

needed_tokens   for JSON gates: the tokens up to the end of the first complete JSON value. The rest was decode
                the gate did not need (stop on schema, or a lower max_tokens, would have saved it).
repeat_share    the share of the answer's words whose trigram (with the two words before) already occurs in
                the prompt or earlier in the answer: roughly what n-gram prompt lookup would have accepted.
                Templated output (schemas, copied ids) scores high; speculation pays off there.
"""

from __future__ import annotations

import json
import re

from twospeed.lab.prompts import TokenCounter

JSON_GATES = ("json", "json_schema")
_WORD = re.compile(r"\w+|[^\w\s]")


def needed_tokens(text: str, output_tokens: int, gate: dict, counter: TokenCounter) -> int | None:
    """Tokens up to the end of the answer's first JSON value (None when the gate is not a JSON gate or the
    answer holds no complete JSON value)."""
    if gate.get("type") not in JSON_GATES and not (gate.get("type") == "allowed_codes" and gate.get("field")):
        return None
    body = text.lstrip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
    try:
        _, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    chars = len(text) - len(body) + end
    if counter.exact:
        return min(output_tokens, counter.count(text[:chars]))
    return max(1, round(output_tokens * chars / len(text))) if text else None


def repeat_share(prompt: str, answer: str) -> float | None:
    """Share of the answer's words predictable from a trigram already seen (None for answers under 3 words)."""
    a = _WORD.findall(answer)
    if len(a) < 3:
        return None
    p = _WORD.findall(prompt)
    seen = {tuple(p[i:i + 3]) for i in range(len(p) - 2)}
    hits = 0
    for i in range(2, len(a)):
        gram = tuple(a[i - 2:i + 1])
        hits += gram in seen
        seen.add(gram)
    return hits / (len(a) - 2)
