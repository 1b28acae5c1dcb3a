"""Structured output over HTTP with the official openai client: response_format (json_object, json_schema)
on both endpoints, tools + tool_choice on chat (auto, required, none, a named function), streaming and not;
greedy constrained output token-identical to LLM.generate; malformed schemas and tools are 400s naming the
field, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_harness import ENGINE, ServerProcess
from twospeed import LLM, SamplingParams
from twospeed.engine.sampling_params import StructuredOutput

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "langs"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "langs": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["en", "fr", "de"]}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 12, "pattern": "^[A-Za-z ]+$"},
    "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["tz"], "properties": {
    "tz": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
OPTIONS = {**ENGINE, "max_model_len": 1024}  # the chat template renders the tools into the prompt


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", str(OPTIONS["max_model_len"]))
    yield srv
    srv.stop_clean()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_chat_json_schema_sampled_choices_validate(client):
    r = client.chat.completions.create(model="demo", messages=MESSAGES, n=4, temperature=1.0, seed=5,
                                       max_tokens=80, response_format=_json_schema(PERSON))
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    bill = r.model_extra["twospeed"]["bill"]
    assert 0 < bill["forced_tokens"] < bill["output_tokens"] == r.usage.completion_tokens


def test_completion_json_schema_greedy_matches_llm_generate(client):
    prompt = "Describe a person:"
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=80, temperature=0,
                                  extra_body={"response_format": _json_schema(PERSON), "return_token_ids": True})
    reference = LLM("demo", **OPTIONS).generate(
        prompt, SamplingParams(max_tokens=80, temperature=0, structured=StructuredOutput(json=PERSON)))[0]
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == reference.token_ids and choice.text == reference.text
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), PERSON)


def test_json_object_streaming_on_both_endpoints(client):
    stream = client.completions.create(model="demo", prompt="JSON please:", max_tokens=48, temperature=0,
                                       stream=True, extra_body={"response_format": {"type": "json_object"}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [chunks[-1].choices[0].finish_reason]
    if finish[0] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut off by max_tokens: still the start of an object
        assert text.startswith("{")
    stream = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=80, temperature=1.0, seed=2,
                                            stream=True, response_format=_json_schema(PERSON))
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(content), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_valid_tool_calls(client, stream):
    for seed in range(3):
        kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                      seed=seed, max_tokens=80)
        if stream:
            calls, finish, content = {}, None, ""
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
                    calls[tc.index]["name"] += tc.function.name or ""
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert content == "" and len(calls) == 1
            call = calls[0]
            assert call["id"].startswith("call_")
        else:
            r = client.chat.completions.create(**kwargs)
            msg = r.choices[0].message
            finish = r.choices[0].finish_reason
            assert msg.content is None and len(msg.tool_calls) == 1 and msg.tool_calls[0].type == "function"
            call = {"name": msg.tool_calls[0].function.name, "arguments": msg.tool_calls[0].function.arguments}
        assert finish == "tool_calls"
        assert call["name"] in PARAMS
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_named_tool_choice_forces_that_function(client):
    r = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, n=3, temperature=1.0, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=40)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_tool_choice_auto_gives_text_or_a_valid_call_and_none_gives_text(client):
    r = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="auto", n=8,
                                       temperature=1.0, seed=3, max_tokens=24)
    for choice in r.choices:
        msg = choice.message
        if msg.tool_calls:
            assert choice.finish_reason == "tool_calls" and msg.content is None
            fn = msg.tool_calls[0].function
            jsonschema.validate(json.loads(fn.arguments), PARAMS[fn.name])
        else:
            assert choice.finish_reason in ("stop", "length") and not msg.content.startswith("{")
    r = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


BAD = [
    ({"messages": MESSAGES, "response_format": _json_schema({"type": "integer", "minimum": 5, "maximum": 1})},
     "response_format", "minimum"),
    ({"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     "tools", "tools[0].function.parameters.properties.a"),
    ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "tool_choice", "missing"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
]


@pytest.mark.parametrize("body, param, words", BAD, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_schemas_and_tools_are_400(server, body, param, words):
    r = httpx.post(f"{server.url}/chat/completions", json={"model": "demo", "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(f"{server.url}/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_auto_tool_grammar_admits_a_valid_call_or_text_and_nothing_else():
    """A random-weight model seldom starts with "{", so the call branch of "auto" is checked on the grammar."""
    from twospeed.engine.structured import GrammarCompiler
    from twospeed.builtin.demo import demo_checkpoint_path
    from twospeed.model.tokenizer import Tokenizer
    from twospeed.server.protocol import ChatCompletionRequest

    tok = Tokenizer.from_pretrained(demo_checkpoint_path())
    compiler = GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)
    body = ChatCompletionRequest(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="auto")

    def accepts(text: str) -> bool:
        matcher = compiler.new_state(body.structured_output()).matcher
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    call = '{"name":"get_time","arguments":{"tz":"UTC"}}'
    assert accepts(call) and body.parse_tool_call(call) == {"name": "get_time", "arguments": {"tz": "UTC"}}
    assert accepts("Sunny, 20 degrees.") and body.parse_tool_call("Sunny, 20 degrees.") is None
    assert not accepts('{"name":"get_time","arguments":{"tz":"EST"}}')  # not in the enum
    assert not accepts('{"name":"get_weather","arguments":{"city":"Paris"}}')  # "unit" is required
    assert not accepts('{"answer":1}')  # text may not start with "{" unless it is a call
