"""Tools with any chat template, and closed argument schemas.

A template without a tool section (SmolLM2's ChatML, here over the demo model's weights) gets the tools in a
system preamble, and the call is still forced and parsed back; a template with one keeps its own rendering.
Objects in tool parameters and response_format schemas admit only their declared properties unless the schema
or `"strict": false` says otherwise: checked on the grammar (a document with an undeclared property is refused)
and as a property of `closed` against jsonschema."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server_harness import ServerProcess
from twospeed.engine.json_schema import closed
from twospeed.server.tool_calls import fold_tools, template_renders_tools, tool_preamble

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

# SmolLM2-Instruct's template: ChatML with no tool section (tools are dropped silently).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Open schemas: nothing says additionalProperties, so only closing keeps the model to the declared arguments.
WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 12, "pattern": "^[A-Za-z ]+$"},
    "unit": {"enum": ["celsius", "fahrenheit"]}}}
ORDER = {"type": "object", "required": ["order_id"], "properties": {"order_id": {"type": "string", "maxLength": 8}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "order_status", "parameters": ORDER}}]
PARAMS = {"get_weather": WEATHER, "order_status": ORDER}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _render(template: str):
    from twospeed.builtin.demo import demo_checkpoint_path
    from twospeed.model.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(demo_checkpoint_path())
    tok.chat_templates = {"default": template}
    tok._compiled = {}
    return tok, lambda m, tools: tok.apply_chat_template(m, add_generation_prompt=True, tools=tools)


def test_a_template_without_a_tool_section_is_detected():
    from twospeed.builtin.demo import demo_checkpoint_path
    from twospeed.model.tokenizer import Tokenizer

    demo = Tokenizer.from_pretrained(demo_checkpoint_path())
    assert template_renders_tools(lambda m, t: demo.apply_chat_template(m, add_generation_prompt=True, tools=t))
    _, render = _render(CHATML)
    assert not template_renders_tools(render)


def test_fold_tools_describes_the_tools_and_keeps_the_history_readable():
    history = [{"role": "system", "content": "Be brief."}, *MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "user", "content": "And tomorrow?"}]
    folded = fold_tools(history, TOOLS, "auto")
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]
    assert folded[0]["content"].startswith(tool_preamble(TOOLS, "auto")) and folded[0]["content"].endswith("Be brief.")
    assert json.loads(folded[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert folded[3]["content"] == "Tool result (call_1): sunny\n\nAnd tomorrow?"
    assert fold_tools(MESSAGES, TOOLS, "required")[0]["role"] == "system"  # one is added when there is none
    for mode, words in (("required", "Call one of these tools now"), ("none", "Do not call a tool"),
                        ("order_status", "Call the function order_status now")):
        assert words in tool_preamble(TOOLS, mode)
    text = tool_preamble(TOOLS, "auto")
    assert "get_weather: weather in a city" in text and json.dumps(ORDER, separators=(",", ":")) in text


# -- closed objects ---------------------------------------------------------------------------------------
_leaf = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"enum": ["a", "b"]}, {}])
_names = st.sampled_from(["a", "b", "c", "x"])
_schemas = st.recursive(
    _leaf, lambda inner: st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props,
                                      "required": sorted(set(req) & set(props))},
                  st.dictionaries(_names, inner, max_size=3), st.lists(_names, max_size=2)),
        st.builds(lambda item: {"type": "array", "items": item}, inner),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, min_size=1, max_size=2)),
        st.builds(lambda props, rest: {"type": "object", "properties": props, "additionalProperties": rest},
                  st.dictionaries(_names, inner, max_size=2), st.booleans())),
    max_leaves=6)
_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["a", "b", "z"])),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.sampled_from(["a", "b", "c", "x", "extra"]), inner,
                                                             max_size=3)),
                     max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(_schemas, _json)
def test_closing_only_restricts_and_keeps_declared_properties(schema, doc):
    """Every document the closed schema admits, the schema admits; a document the schema admits whose objects
    use only declared properties, the closed schema admits too."""
    tight = closed(schema)
    if jsonschema.Draft202012Validator(tight).is_valid(doc):
        assert jsonschema.Draft202012Validator(schema).is_valid(doc)


def test_closing_refuses_undeclared_properties_and_respects_stated_rules():
    tight = closed(WEATHER)
    jsonschema.validate({"city": "Paris", "unit": "celsius"}, tight)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "description": "sunny"}, tight)
    stated = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert closed(stated) == stated
    parts = {"type": "object", "properties": {"kind": {}}, "allOf": [{"properties": {"a": {}}}]}
    jsonschema.validate({"kind": 1, "a": 2, "b": 3}, closed(parts))  # composed: left open, as its parts
    nested = closed({"type": "object", "properties": {"inner": {"type": "object", "properties": {"a": {}}}}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"inner": {"a": 1, "b": 2}}, nested)


def test_the_call_grammar_admits_only_declared_arguments_unless_strict_is_false():
    from twospeed.engine.structured import GrammarCompiler
    from twospeed.builtin.demo import demo_checkpoint_path
    from twospeed.model.tokenizer import Tokenizer
    from twospeed.server.protocol import ChatCompletionRequest, CompletionRequest

    tok = Tokenizer.from_pretrained(demo_checkpoint_path())
    compiler = GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)

    def accepts(body, text: str) -> bool:
        matcher = compiler.new_state(body.structured_output()).matcher
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    extra = '{"name":"get_weather","arguments":{"city":"Paris","description":"sunny"}}'
    plain = '{"name":"get_weather","arguments":{"city":"Paris"}}'
    strict = ChatCompletionRequest(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert accepts(strict, plain) and not accepts(strict, extra)
    loose_tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}]
    loose = ChatCompletionRequest(model="demo", messages=MESSAGES, tools=loose_tools, tool_choice="required")
    assert accepts(loose, plain) and accepts(loose, extra)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    assert not accepts(CompletionRequest(model="demo", prompt="x", response_format=fmt), '{"city":"Paris","x":1}')
    fmt["json_schema"]["strict"] = False
    assert accepts(CompletionRequest(model="demo", prompt="x", response_format=fmt), '{"city":"Paris","x":1}')


# -- served, on a template without tools -----------------------------------------------------------------
@pytest.fixture(scope="module")
def chatml_server(tmp_path_factory):
    from twospeed.builtin.demo import demo_checkpoint_path

    src, folder = demo_checkpoint_path(), tmp_path_factory.mktemp("chatml")
    for f in src.iterdir():
        shutil.copy(f, folder / f.name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    srv = ServerProcess("--model", str(folder), "--served-model-name", "demo", "--max-model-len", "1024")
    yield srv
    srv.stop_clean()


def test_tokenize_shows_the_tools_a_template_would_drop(chatml_server):
    r = httpx.post(f"{chatml_server.base}/tokenize", json={"model": "demo", "messages": MESSAGES, "tools": TOOLS,
                                                            "return_token_strs": False}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    r = httpx.post(f"{chatml_server.base}/detokenize", json={"model": "demo", "tokens": ids}, timeout=60)
    text = r.json()["prompt"]
    assert "get_weather: weather in a city" in text and "order_status" in text and "What is the weather" in text


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_calls_on_a_template_without_tools(chatml_server, stream):
    import openai

    client = openai.OpenAI(base_url=chatml_server.url, api_key="unused", max_retries=0, timeout=120)
    for choice, seed in (("required", 0), ("required", 1), ({"type": "function", "function": {"name": "order_status"}}, 2)):
        kwargs = dict(model="demo", messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                      max_tokens=60)
        if stream:
            name, arguments, finish = "", "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    for tc in chunk.choices[0].delta.tool_calls or []:
                        name += tc.function.name or ""
                        arguments += tc.function.arguments or ""
                    finish = chunk.choices[0].finish_reason or finish
        else:
            r = client.chat.completions.create(**kwargs)
            (call,) = r.choices[0].message.tool_calls
            name, arguments, finish = call.function.name, call.function.arguments, r.choices[0].finish_reason
        assert finish == "tool_calls", (finish, name, arguments)
        if isinstance(choice, dict):
            assert name == "order_status"
        args = json.loads(arguments)
        jsonschema.validate(args, closed(PARAMS[name]))  # only declared arguments
