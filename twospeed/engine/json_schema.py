"""JSON schemas that requests bring: valid against their meta-schema, and admitting a finite document.

Checked once per distinct schema: results are cached by the schema's canonical JSON, so the server's
400 check and the grammar compiler's share one validation, and an agent that sends the same tool
schemas with every request pays for them once.

A finite document: `{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`, or an object whose
required property is that object again, is valid JSON Schema that no finite JSON value satisfies; a
grammar compiled from it either accepts nothing (the model is stopped at once, with empty text) or
only endless nesting. `finite_document_problem` finds these as a least fixpoint over the `$ref`
targets: a subschema admits a finite document if some branch of it does without going through a
target not yet shown to. Recursion that can stop (an optional property, an array that may be empty,
an `anyOf` with a non-recursive branch) passes. Constraints other than recursion (an empty enum, a
minimum above the maximum) are the grammar compiler's to refuse.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any
from urllib.parse import unquote

import jsonschema


class SchemaProblem(ValueError):
    """A schema that cannot be used: `path` is where in the schema (keys and indices), `reason` what is wrong
    ("is not a valid JSON schema: ..."), `detail` the meta-schema's own message when that is the problem."""

    def __init__(self, path: list, reason: str, detail: str | None = None):
        super().__init__(reason)
        self.path, self.reason, self.detail = path, reason, detail


_CACHE_SIZE = 512
_cache: OrderedDict[str, SchemaProblem | None] = OrderedDict()
_lock = threading.Lock()


def check_schema(schema: Any) -> None:
    """Raise SchemaProblem if `schema` is not a valid JSON schema or admits no finite document (cached)."""
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        raise SchemaProblem([], "is not a JSON value (or is nested too deeply)") from None
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            problem = _cache[key]
            if problem is not None:
                raise problem
            return
    problem = _problem(schema)
    with _lock:
        _cache[key] = problem
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    if problem is not None:
        raise problem


def _problem(schema: Any) -> SchemaProblem | None:
    if not isinstance(schema, (dict, bool)):
        return SchemaProblem([], "must be a JSON schema (an object or a boolean)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return SchemaProblem(list(e.path), f"is not a valid JSON schema: {e.message}", e.message)
    except RecursionError:
        return SchemaProblem([], "is nested too deeply")
    try:
        reason = finite_document_problem(schema)
    except RecursionError:
        return SchemaProblem([], "is nested too deeply")
    return None if reason is None else SchemaProblem([], reason)


# -- does some finite document satisfy it? --------------------------------------------------------------
def finite_document_problem(schema: dict | bool) -> str | None:
    """None if some finite JSON value can satisfy `schema` as far as its recursion goes, else why not."""
    targets: dict[str, Any] = {}
    _collect_refs(schema, schema, targets)
    finite = {ref: False for ref in targets}  # least fixpoint: nothing is known to be finite yet
    changed = True
    while changed:
        changed = False
        for ref, node in targets.items():
            if not finite[ref] and _finite(node, finite):
                finite[ref] = changed = True
    if _finite(schema, finite):
        return None
    stuck = [ref for ref, ok in finite.items() if not ok]
    if stuck:
        return (f"admits no finite document: its $ref recursion never ends ({', '.join(stuck[:3])} "
                "can only contain itself again; make the recursive part optional or give it a way out)")
    return "admits no document (it is, or requires, the schema false)"


def _collect_refs(root: Any, node: Any, targets: dict[str, Any]) -> None:
    """Every local $ref in the schema, resolved to its subschema (remote or unresolvable ones are skipped)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in targets:
                target = _resolve(root, ref)
                if target is not None:
                    targets[ref] = target
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _resolve(root: Any, ref: str) -> Any:
    if ref == "#" or ref == "":
        return root
    if not ref.startswith("#/"):
        return None  # remote, or an anchor: not followed (assumed finite)
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _finite(node: Any, finite: dict[str, bool]) -> bool:
    """Whether some finite value satisfies node, given what is known of the $ref targets."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    if not all(_finite(s, finite) for s in node.get("allOf", [])):
        return False
    for key in ("anyOf", "oneOf"):
        if node.get(key) and not any(_finite(s, finite) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True  # a listed value is finite (whether it also fits the rest is the compiler's concern)
    types = node.get("type", list(_TYPES))
    types = [types] if isinstance(types, str) else types
    return any(_finite_as(t, node, finite) for t in types)


def _finite_as(kind: str, node: dict, finite: dict[str, bool]) -> bool:
    if kind == "object":
        props = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        return all(_finite(props.get(name, extra), finite) for name in node.get("required", []))
    if kind == "array":
        tuple_items = isinstance(node.get("items"), list)  # draft 7's tuple form
        prefix = node.get("prefixItems", node["items"] if tuple_items else [])
        items = node.get("additionalItems", True) if tuple_items else node.get("items", True)
        needed = max(node.get("minItems", 0), 0)
        if "contains" in node and node.get("minContains", 1) > 0 and not _finite(node["contains"], finite):
            return False
        # The first `needed` items must exist: the prefix's, then `items` (one check covers them all).
        return all(_finite(prefix[i] if i < len(prefix) else items, finite)
                   for i in range(min(needed, len(prefix) + 1)))
    return True


# -- closed objects: only the declared properties --------------------------------------------------------
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any) -> Any:
    """A copy of the schema whose objects admit only their declared properties: every object subschema that says
    nothing about other properties gets `additionalProperties: false`.

    JSON Schema's default admits any other property, so a grammar compiled from a tool's parameters lets the
    model write arguments the function never declared, and it does (a 135M model invents "description" fields
    until max_tokens). OpenAI's strict mode and xgrammar (vLLM's default) close objects the same way. Left open:
    an object that states `additionalProperties`, `patternProperties` or `unevaluatedProperties` (its own rule);
    an object whose properties are also declared by `allOf`/`anyOf`/`oneOf` branches beside its own, and those
    branches (each is a part of one object: closed, they would refuse each other's properties); and `allOf`
    branches. The objects inside all of them are closed. An `anyOf` of whole objects (no properties beside it)
    closes each alternative."""
    return _close(schema, part=False)


def _close(schema: Any, part: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    composed = any(isinstance(out.get(k), list) for k in ("allOf", "anyOf", "oneOf"))
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub, False) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(sub, is_object and key != "prefixItems") for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(sub, True) for sub in out["allOf"]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], False)
    if isinstance(out.get("items"), list):  # draft 4-7 tuple form
        out["items"] = [_close(sub, False) for sub in out["items"]]
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"], False)
    if is_object and not part and not composed and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
