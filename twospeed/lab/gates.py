"""Gates: is an answer usable? Pure functions of (output text, the request's meta, the gate's config).

json           the answer parses as JSON (surrounding whitespace and a ```json fence are allowed)
json_schema    it parses and validates against `schema` (the jsonschema library)
citation       every cited passage id ([P012]) exists in the prompt; at least `min_citations` of them
allowed_codes  the answer (or its JSON `field`) is one of `codes` (or the request's meta allowed_codes)
refusal        a refusal is detected where one is expected (`expect: true`, or the request's meta
               `expect_refusal`, as task prompts set it) or not (default)
none           always passes

A failed gate is a result, never an exception: it shows in the report and takes the request out of goodput.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema

CITATION = re.compile(r"\[(P\d{3,})\]")
REFUSAL = re.compile(r"\b(I can(?:no|')t|I(?: am|'m) (?:unable|not able)|I won't|I will not|I must decline|"
                     r"as an AI|I'm sorry, but|cannot (?:help|assist|comply))\b", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class GateResult:
    passed: bool
    reason: str = ""  # why it failed (empty when it passed)


def parse_json(text: str):
    """The answer's JSON value (surrounding whitespace and a ```json fence allowed); ValueError if it is none."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    return json.loads(fence.group(1) if fence else body)


def gate_json(text: str, meta: dict, config: dict) -> GateResult:
    try:
        parse_json(text)
    except ValueError as e:
        return GateResult(False, f"not JSON: {e}")
    return GateResult(True)


def gate_json_schema(text: str, meta: dict, config: dict) -> GateResult:
    try:
        value = parse_json(text)
    except ValueError as e:
        return GateResult(False, f"not JSON: {e}")
    try:
        jsonschema.validate(value, config["schema"])
    except jsonschema.ValidationError as e:
        return GateResult(False, f"schema: {e.message}")
    return GateResult(True)


def gate_citation(text: str, meta: dict, config: dict) -> GateResult:
    cited = CITATION.findall(text)
    known = set(meta.get("passage_ids", []))
    unknown = sorted(set(cited) - known)
    if unknown:
        return GateResult(False, f"cites passages not in the prompt: {', '.join(unknown)}")
    need = int(config.get("min_citations", 1))
    if len(set(cited)) < need:
        return GateResult(False, f"cites {len(set(cited))} passage(s), needs {need}")
    return GateResult(True)


def gate_allowed_codes(text: str, meta: dict, config: dict) -> GateResult:
    codes = set(config.get("codes") or meta.get("allowed_codes") or [])
    if not codes:
        return GateResult(False, "no allowed codes configured")
    answer = text.strip()
    if config.get("field"):
        try:
            value = parse_json(text)
        except ValueError as e:
            return GateResult(False, f"not JSON: {e}")
        if not isinstance(value, dict) or config["field"] not in value:
            return GateResult(False, f"no field {config['field']!r}")
        answer = str(value[config["field"]])
    return GateResult(True) if answer in codes else GateResult(False, f"{answer[:40]!r} not an allowed code")


def gate_refusal(text: str, meta: dict, config: dict) -> GateResult:
    refused = REFUSAL.search(text) is not None
    expect = bool(meta.get("expect_refusal", config.get("expect", False)))  # the request's own, else the lane's
    if refused == expect:
        return GateResult(True)
    return GateResult(False, "refused" if refused else "did not refuse")


def gate_none(text: str, meta: dict, config: dict) -> GateResult:
    return GateResult(True)


GATES: dict[str, Callable[[str, dict, dict], GateResult]] = {
    "json": gate_json, "json_schema": gate_json_schema, "citation": gate_citation,
    "allowed_codes": gate_allowed_codes, "refusal": gate_refusal, "none": gate_none}


def check_config(config: dict) -> None:
    """Fail early on a gate the lab does not know or a schema that is not a schema."""
    kind = config.get("type", "none")
    if kind not in GATES:
        raise ValueError(f"unknown gate {kind!r}; expected one of {sorted(GATES)}")
    if kind == "json_schema":
        if "schema" not in config:
            raise ValueError("gate json_schema needs a 'schema'")
        jsonschema.validators.validator_for(config["schema"]).check_schema(config["schema"])


def run_gate(config: dict, text: str, meta: dict) -> GateResult:
    return GATES[config.get("type", "none")](text, meta, config)
