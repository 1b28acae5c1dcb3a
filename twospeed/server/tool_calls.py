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


# -- tools for a chat template that does not render them --------------------------------------------------
_PROBE_TOOL = {"type": "function", "function": {"name": "twospeed_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_MESSAGES = [{"role": "user", "content": "hello"}]


def template_renders_tools(render) -> bool:
    """Whether a chat template shows the model its tools: render(messages, tools) with a probe tool and without
    one must differ, and the tool's name must appear. Many templates (SmolLM2's ChatML, most base-model ones) have
    no tool section and drop `tools` silently."""
    try:
        with_tool = render(_PROBE_MESSAGES, [_PROBE_TOOL])
        without = render(_PROBE_MESSAGES, None)
    except Exception:  # a template that fails on the probe: let the real request show its own error
        return True
    return with_tool != without and "twospeed_probe_tool" in with_tool


def tool_preamble(tools: list[dict], mode: str) -> str:
    """The system text that describes the tools and the call format (the same compact object the call grammar
    generates and parse_call reads back), for `mode`: "auto", "required", "none" or a function's name."""
    lines = ["You have these tools (functions):"]
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters", {"type": "object", "properties": {}})
        lines.append(f"- {fn['name']}: {fn.get('description') or '(no description)'}")
        lines.append(f"  arguments (JSON schema): {json.dumps(params, separators=(',', ':'))}")
    call = 'reply with only one JSON object, {"name": <the function name>, "arguments": {<its arguments>}}, ' \
           "and nothing else"
    if mode == "auto":
        lines.append(f"To call a tool, {call}. Otherwise answer in plain text.")
    elif mode == "required":
        lines.append(f"Call one of these tools now: {call}.")
    elif mode == "none":
        lines.append("Do not call a tool now: answer in plain text.")
    else:
        lines.append(f"Call the function {mode} now: {call}.")
    return "\n".join(lines)


def fold_tools(messages: list[dict], tools: list[dict], mode: str) -> list[dict]:
    """The conversation for a template without a tool section: the tool preamble leads the system message (one is
    added if there is none), an assistant's earlier calls become its text (the JSON objects it generated) and a
    tool's result becomes a user message naming the call it answers, merged with a user message beside it (a
    template may insist that roles alternate)."""
    preamble = tool_preamble(tools, mode)
    out: list[dict] = []
    if not messages or messages[0].get("role") != "system":
        out.append({"role": "system", "content": preamble})
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if i == 0 and role == "system":
            out.append({"role": "system", "content": f"{preamble}\n\n{content}" if content else preamble})
        elif role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role in ("tool", "function"):
            ref = m.get("tool_call_id") or m.get("name") or ""
            _append_user(out, f"Tool result ({ref}): {content}")
        elif role == "user":
            _append_user(out, content)
        else:
            out.append({"role": role, "content": content})
    return out


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = fn.get("arguments")
    return json.dumps({"name": fn.get("name"), "arguments": arguments}, separators=(",", ":"))


def _append_user(out: list[dict], content) -> None:
    if out and out[-1]["role"] == "user":
        out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{content}"}
    else:
        out.append({"role": "user", "content": content})
