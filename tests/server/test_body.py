"""The server's request rules without a server: the sliced JSON parser against json.loads, the Unicode check's
field paths, OpenAI's conversation rules for tool messages, cut-off tool calls read back, and the auth table."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed.server.body import find_invalid_unicode, load_body, loads_sliced, parse_request
from twospeed.server.config import ServerConfig
from twospeed.server.errors import APIError
from twospeed.server.guard import key_given, needs_key
from twospeed.server.messages import ChatMessage, check_conversation
from twospeed.server.protocol import ChatCompletionRequest
from twospeed.server.tool_calls import partial_call

# -- the sliced parser is json.loads ------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children,
                                                                                         max_size=4),
                    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=JSON, indent=st.sampled_from([None, 1]), ascii_only=st.booleans())
def test_loads_sliced_equals_json_loads(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert loads_sliced(text) == json.loads(text)
    assert loads_sliced(f" \n{text}\t ") == json.loads(text)


@pytest.mark.parametrize("text", ['{"a": 1,}', '{"a" 1}', "[1 2]", '{"a": [1, 2}', "[", "{", '{"a": 1} x', "",
                                  '{1: 2}', "[1,]", '{"a": {"b": }}'])
def test_loads_sliced_refuses_what_json_loads_refuses(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        loads_sliced(text)


# -- invalid Unicode is a 400 naming the field --------------------------------------------------------------
@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    (b'{"prompt": "ok", "stop": ["fine", "\\ud83d"]}', "stop.1"),
    (b'{"prompt": "ok", "lane": "x\\udc80"}', "lane"),
    (b'{"prompt": "ok", "response_format": {"type": "json_schema", "json_schema": {"schema": {"description": '
     b'"\\ud800"}}}}', "response_format.json_schema.schema.description"),
    (b'{"prompt": "ok", "\\ud800": 1}', "\\ud800"),  # a key: named with the bad character escaped
    (b'{"prompt": "a\xffb"}', "prompt"),  # bytes that are not UTF-8
    (b'{"prompt": "ok", "user": "\xc3"}', "user"),
])
def test_invalid_unicode_anywhere_names_the_field(raw, param):
    with pytest.raises(APIError) as e:
        load_body(raw)
    assert e.value.status == 400 and e.value.param == param and "not valid Unicode" in e.value.message


def test_valid_surrogate_pairs_and_escaped_backslashes_pass():
    assert load_body(b'{"prompt": "\\ud83d\\ude00 and \\\\ud800"}') == {"prompt": "\U0001F600 and \\ud800"}
    assert find_invalid_unicode({"a": ["ok", {"b": "fine"}]}) is None


def test_long_message_lists_are_validated_item_by_item_with_the_right_index():
    messages = [{"role": "user", "content": f"m{i}"} for i in range(600)]
    body = parse_request(json.dumps({"messages": messages}).encode(), ChatCompletionRequest)
    assert [m.content for m in body.messages] == [m["content"] for m in messages]
    messages[437] = {"role": "wizard", "content": "x"}
    with pytest.raises(APIError) as e:
        parse_request(json.dumps({"messages": messages}).encode(), ChatCompletionRequest)
    assert e.value.param == "messages.437.role"


# -- OpenAI's rules for tool messages -----------------------------------------------------------------------
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
USER = {"role": "user", "content": "hi"}


def conversation(*messages) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in messages]


GOOD = [
    [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
    [USER, {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
     {"role": "tool", "tool_call_id": "call_2", "content": "b"}, {"role": "tool", "tool_call_id": "call_1",
                                                                  "content": [{"type": "text", "text": "a"}]},
     {"role": "assistant", "content": "done"}, USER],
    [USER, {"role": "function", "name": "f", "content": "old style"}],
]
BAD = [  # (conversation, param, words)
    ([USER, {"role": "tool", "content": "r"}], "messages.1.tool_call_id", "needs a tool_call_id"),
    ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "r"}], "messages.1.tool_call_id",
     "must answer a tool call"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_9", "content": "r"}],
     "messages.2.tool_call_id", "call_9"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1"}],
     "messages.2.content", "needs content"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, USER], "messages.1.tool_calls", "call_1"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}], "messages.1.tool_calls", "not answered: call_1"),
    ([USER, {"role": "assistant", "tool_calls": [CALL, CALL]}, {"role": "tool", "tool_call_id": "call_1",
                                                                "content": "r"}], "messages.1.tool_calls", "unique"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}],
     "messages.1.tool_calls.0", "arguments"),
    ([USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}], "messages.1.tool_calls.0", "function"),
    ([USER, {"role": "function", "content": "no name"}], "messages.1", "needs a name"),
    ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "r"},
      {"role": "tool", "tool_call_id": "call_1", "content": "again"}], "messages.3.tool_call_id", "call_1"),
]


@pytest.mark.parametrize("messages", GOOD, ids=range(len(GOOD)))
def test_valid_tool_conversations_pass(messages):
    check_conversation(conversation(*messages))


@pytest.mark.parametrize("messages, param, words", BAD, ids=[p for _, p, _ in BAD])
def test_tool_message_rules(messages, param, words):
    with pytest.raises(APIError) as e:
        check_conversation(conversation(*messages))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


# -- a tool call cut off by max_tokens ----------------------------------------------------------------------
FUNCTIONS = {"get_weather": {}, "get_time": {}, "search": {}}


@pytest.mark.parametrize("text, expected", [
    ('{"name":"get_weather","arguments":{"city":"Par', {"name": "get_weather", "arguments": '{"city":"Par'}),
    ('{"name":"get_weather","arguments":', {"name": "get_weather", "arguments": ""}),
    ('{"name":"get_weather"', {"name": "get_weather", "arguments": ""}),
    ('{"name":"get_w', {"name": "get_weather", "arguments": ""}),  # one function fits what was generated
    ('{"name":"get_', {"name": "", "arguments": ""}),  # two still do
    ('{"na', {"name": "", "arguments": ""}),
    ("plain text", None),
])
def test_partial_tool_call(text, expected):
    assert partial_call(text, FUNCTIONS) == expected
    full = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    if expected and expected["name"] == "get_weather":
        assert full.startswith(text) and full[len('{"name":"get_weather","arguments":'):].startswith(
            expected["arguments"])


def test_a_forced_function_is_named_however_early_the_cut():
    assert partial_call("{", {"get_time": {}}) == {"name": "get_time", "arguments": ""}


# -- the auth table ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, default, opened", [
    ("/v1/completions", True, True), ("/v1/models", True, True), ("/tokenize", True, True),
    ("/detokenize", True, True), ("/no/such/route", True, True), ("/dashboardx", True, True),
    ("/health", True, False), ("/metrics", True, False), ("/dashboard", True, False), ("/dashboard/data", True, False),
    ("/dashboard/clock", True, False),
    ("/openapi.json", True, False), ("/docs", True, False), ("/docs/oauth2-redirect", True, False),
    ("/redoc", True, False), ("/healthz", True, True), ("/docsx", True, True),
])
def test_every_route_needs_the_key_unless_a_flag_opens_it(path, default, opened):
    assert needs_key(path, ServerConfig(api_key="k")) is default
    assert needs_key(path, ServerConfig(api_key="k", metrics_public=True, docs_public=True)) is opened


@pytest.mark.parametrize("header, ok", [
    (b"Bearer k3y", True), (b"bearer  k3y ", True), (b"Bearer k3", False), (b"Bearer", False), (b"", False),
    (b"Basic " + base64.b64encode(b"anyone:k3y"), True), (b"Basic " + base64.b64encode(b":k3y"), True),
    (b"Basic " + base64.b64encode(b"k3y:"), False), (b"Basic " + base64.b64encode(b"u:k3y2"), False),
    (b"Basic not*base64", False), (b"Token k3y", False),
])
def test_the_key_as_bearer_token_or_basic_password(header, ok):
    assert key_given(header, b"k3y", basic=True) is ok
    assert key_given(header, b"k3y") is (ok and header.lower().startswith(b"bearer"))  # Basic only where allowed
