"""Tool calls: the grammar a call is generated under, and reading a call back from the generated text.

A call is generated as one compact JSON object {"name": ..., "arguments": {...}} (name first: the grammar
keeps the schema's property order), whose arguments follow the function's parameters schema. A call cut
off by max_tokens is still a call, as OpenAI returns it: its name and the arguments text so far.
"""

from __future__ import annotations

import json
import re

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL_HEAD = re.compile(r'\{"name":"((?:[^"\\]|\\.)*)(")?(?:,"arguments":(.*))?', re.S)

# The JSON schemas the OpenAPI document shows for `tools`, `tool_choice` and `response_format` (the server
# validates them itself, with messages naming the field); a fuzzer generating from the document then sends
# calls with real parameter schemas.
_PARAMETERS = {"type": "object", "properties": {
    "type": {"const": "object"},
    "properties": {"type": "object", "additionalProperties": {"type": "object", "properties": {
        "type": {"enum": ["string", "integer", "number", "boolean"]}, "maxLength": {"type": "integer"}}}},
    "required": {"type": "array", "items": {"type": "string"}},
    "additionalProperties": {"type": "boolean"}}}
TOOLS_SCHEMA = {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": _PARAMETERS, "strict": {"type": "boolean"}}}}}}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
RESPONSE_FORMAT_SCHEMA = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "schema": _PARAMETERS, "strict": {"type": "boolean"}}}}}]}


def tool_call_schema(functions: dict[str, dict]) -> dict:
    """The JSON schema of one call of one of these functions: {"name": <const>, "arguments": <its parameters>}."""
    alternatives = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"const": name}, "arguments": params}}
                    for name, params in functions.items()]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def parse_call(text: str, functions: dict[str, dict]) -> dict | None:
    """The complete {"name", "arguments"} object in text, or None for plain text or a cut-off call."""
    if not text.startswith("{"):
        return None
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in functions or not isinstance(call.get("arguments"), dict):
        return None
    return call


def as_generated(text: str, call: dict) -> dict:
    """A complete call with its arguments as the model wrote them (OpenAI's `arguments` is the model's text), so
    a cut-off call's arguments are a prefix of the same call's whole arguments."""
    head = _CALL_HEAD.match(text)
    raw = head.group(3) if head is not None and head.group(3) else None
    if raw is None or not raw.rstrip().endswith("}"):
        return call
    return {"name": call["name"], "arguments": raw.rstrip()[:-1]}


def partial_call(text: str, functions: dict[str, dict]) -> dict | None:
    """A call cut off mid-way: {"name": the function (the one whose name fits what was generated; "" if several
    still do), "arguments": the arguments text so far (a JSON prefix)}; None if text is no call."""
    if not text.startswith("{"):
        return None
    head = _CALL_HEAD.match(text)
    if head is None:  # "{" or a prefix of '{"name":"'
        names = list(functions)
        return {"name": names[0] if len(names) == 1 else "", "arguments": ""}
    try:
        prefix = json.loads(f'"{head.group(1)}"')
    except json.JSONDecodeError:  # cut inside an escape
        prefix = head.group(1)
    names = [n for n in functions if (n == prefix if head.group(2) else n.startswith(prefix))]
    return {"name": names[0] if len(names) == 1 else "", "arguments": head.group(3) or ""}
