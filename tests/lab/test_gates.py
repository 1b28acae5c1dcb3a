"""Every gate of the lab, passing and failing, on hand-made answers."""

import jsonschema
import pytest

from twospeed.lab.gates import GATES, GateResult, check_config, run_gate

TOOL_SCHEMA = {"type": "object", "required": ["tool", "arguments"],
               "properties": {"tool": {"enum": ["lookup_order"]}, "arguments": {"type": "object"}}}


@pytest.mark.parametrize("text, passed", [('{"a": 1}', True), ('  [1, 2]\n', True), ('```json\n{"a": 1}\n```', True),
                                          ('{"a": 1', False), ("hello", False), ("", False)])
def test_json(text, passed):
    assert run_gate({"type": "json"}, text, {}).passed is passed


@pytest.mark.parametrize("text, passed, reason", [
    ('{"tool": "lookup_order", "arguments": {"id": "7"}}', True, ""),
    ('{"tool": "drop_table", "arguments": {}}', False, "schema"),
    ('{"tool": "lookup_order"}', False, "schema"),
    ("lookup_order(7)", False, "not JSON"),
])
def test_json_schema(text, passed, reason):
    r = run_gate({"type": "json_schema", "schema": TOOL_SCHEMA}, text, {})
    assert r.passed is passed and r.reason.startswith(reason)


def test_citation():
    meta = {"passage_ids": ["P003", "P120"]}
    gate = {"type": "citation"}
    assert run_gate(gate, "Shipping is late [P003]. Refunds apply [P120].", meta).passed
    bad = run_gate(gate, "Shipping is late [P003] and [P999].", meta)
    assert not bad.passed and "P999" in bad.reason
    assert not run_gate(gate, "No citations at all.", meta).passed
    assert run_gate({"type": "citation", "min_citations": 0}, "No citations at all.", meta).passed
    assert not run_gate({"type": "citation", "min_citations": 2}, "Only [P003].", meta).passed


def test_allowed_codes():
    assert run_gate({"type": "allowed_codes", "codes": ["A", "B"]}, " B\n", {}).passed
    assert not run_gate({"type": "allowed_codes", "codes": ["A", "B"]}, "C", {}).passed
    by_field = {"type": "allowed_codes", "field": "code"}
    meta = {"allowed_codes": ["RETAIL", "FINANCE"]}
    assert run_gate(by_field, '{"code": "RETAIL", "confidence": 0.9}', meta).passed
    assert not run_gate(by_field, '{"code": "RETALE"}', meta).passed
    assert not run_gate(by_field, '{"kode": "RETAIL"}', meta).passed
    assert not run_gate(by_field, "RETAIL", meta).passed  # not JSON
    assert not run_gate({"type": "allowed_codes"}, "RETAIL", {}).passed  # nothing allowed


def test_refusal():
    refusal = "I'm sorry, but I can't help with that request."
    answer = "The order ships on Monday."
    assert run_gate({"type": "refusal"}, answer, {}).passed
    assert not run_gate({"type": "refusal"}, refusal, {}).passed
    assert run_gate({"type": "refusal", "expect": True}, refusal, {}).passed
    assert not run_gate({"type": "refusal", "expect": True}, answer, {}).passed


def test_none_and_config_checks():
    assert run_gate({"type": "none"}, "", {}).passed
    assert set(GATES) == {"json", "json_schema", "citation", "allowed_codes", "refusal", "none"}
    with pytest.raises(ValueError, match="unknown gate"):
        check_config({"type": "jsn"})
    with pytest.raises(ValueError, match="needs a 'schema'"):
        check_config({"type": "json_schema"})
    with pytest.raises(jsonschema.SchemaError):
        check_config({"type": "json_schema", "schema": {"type": "objekt"}})


def test_failures_say_why():
    """The reason is what the report shows for a failed request: each gate's exact verdict."""
    meta = {"passage_ids": ["P003"]}
    assert run_gate({"type": "json"}, "nope", {}) == GateResult(False, "not JSON: Expecting value: line 1 column 1 "
                                                                       "(char 0)")
    assert run_gate({"type": "json"}, '```\n{"a":\n 1}\n```', {}) == GateResult(True)  # a fence over lines
    assert run_gate({"type": "citation"}, "[P003] [P999] [P777]", meta) == GateResult(
        False, "cites passages not in the prompt: P777, P999")
    assert run_gate({"type": "citation"}, "[P003] [P999]", {}) == GateResult(
        False, "cites passages not in the prompt: P003, P999")  # no passage ids: nothing is known
    assert run_gate({"type": "citation"}, "none", meta) == GateResult(False, "cites 0 passage(s), needs 1")
    assert run_gate({"type": "citation"}, "[P003] twice [P003]", meta) == GateResult(True)  # the default: one
    assert run_gate({"type": "allowed_codes"}, "X", {}) == GateResult(False, "no allowed codes configured")
    codes = {"type": "allowed_codes", "codes": ["A"], "field": "code"}
    assert run_gate(codes, "A", {}).reason.startswith("not JSON: ") and not run_gate(codes, "A", {}).passed
    assert run_gate(codes, '{"kode": "A"}', {}) == GateResult(False, "no field 'code'")
    assert run_gate(codes, "[1]", {}) == GateResult(False, "no field 'code'")
    long = "Z" * 50
    assert run_gate({"type": "allowed_codes", "codes": ["A"]}, long, {}) == GateResult(
        False, f"{'Z' * 40!r} not an allowed code")
    assert run_gate({"type": "refusal"}, "I cannot help with that.", {}) == GateResult(False, "refused")
    assert run_gate({"type": "refusal", "expect": True}, "Sure.", {}) == GateResult(False, "did not refuse")
    assert run_gate({}, "anything", {}) == GateResult(True)  # no type: the none gate


def test_config_checks_name_the_problem():
    check_config({})  # no type: none
    check_config({"type": "json_schema", "schema": TOOL_SCHEMA})
    with pytest.raises(ValueError, match=r"^gate json_schema needs a 'schema'$"):
        check_config({"type": "json_schema"})
    with pytest.raises(ValueError, match=r"unknown gate 'x'; expected one of \['allowed_codes', 'citation'"):
        check_config({"type": "x"})
    with pytest.raises(jsonschema.SchemaError):  # the schema is checked, not only its presence
        check_config({"type": "json_schema", "schema": {"minLength": -1}})
