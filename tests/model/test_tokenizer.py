"""Tokenizer wrapper against transformers' reference, and the streaming detokenizer's invariants."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twospeed.builtin.demo import write_demo_tokenizer
from twospeed.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["Hello world", " leading space", "emoji 😀👍🏽 and 中文 and café", "a\n\n  b\t\tc   ", "", " ",
         '{"key": [1, 2.5, null], "x": "y"}', "def f(x):\n    return x ** 2\n", "<|im_end|> inside text",
         "Zürich ñ ß 🇺🇳 \u200b end"]

# Condensed from Llama 3.1 Instruct's template: bos_token, tojson(indent=4), raise_exception, tools.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content | tojson + "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# namespace(), {% generation %}, reasoning aliases and a custom kwarg, as newer templates use them.
FEATURES_TEMPLATE = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}{% set ns.n = ns.n + 1 %}
{%- if m.role == 'assistant' %}{% generation %}<think>{{ m.thinking | default('') }}</think>{{ m.content }}{% endgeneration %}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}{% endfor %}{{ ns.n }} {{ eos_token }} {{ pad_token }} {{ enable_thinking | default(true) }}
{%- if add_generation_prompt %}assistant:{% endif %}"""

SYSTEM = {"role": "system", "content": "You are terse. Use <b>tags</b> & 'quotes'."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in a city, ünïcode",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CALL = {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [SYSTEM, {"role": "user", "content": "  2+2?  "}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 😀?"}],
    [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}, TOOL_CALL, {"role": "tool", "content": "sunny"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_demo_tokenizer(tmp_path_factory.mktemp("demo_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def with_config(tmp_path, tok_dir, **files: dict):
    """A copy of the demo tokenizer folder with some JSON files replaced."""
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return tmp_path


def test_special_ids_come_from_all_config_files(tmp_path, tok, tok_dir):
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (8192, 0, frozenset({1}))
    folder = with_config(tmp_path, tok_dir, tokenizer_config={"eos_token": {"content": "<|im_end|>", "special": True}},
                         generation_config={"eos_token_id": [1, 4]}, config={"bos_token_id": 0, "eos_token_id": 2})
    t = Tokenizer.from_pretrained(folder)
    assert (t.bos_token_id, t.eos_token_ids, t.chat_template) == (0, frozenset({1, 2, 3, 4}), None)
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(tok, hf, text):
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system+turns", "tools"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_demo_chat_template_matches_hf(tok, hf, conversation, generation_prompt):
    for tools in (None, TOOLS):
        ours = tok.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tools=tools)
        ref = hf.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tools=tools,
                                     tokenize=False)
        assert ours == ref
        assert tok.encode(ours, add_special_tokens=False) == hf.encode(ref, add_special_tokens=False)


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, FEATURES_TEMPLATE], ids=["llama3", "features"])
def test_other_templates_match_hf(tmp_path, tok_dir, template):
    transformers = pytest.importorskip("transformers")
    folder = with_config(tmp_path, tok_dir, tokenizer_config={
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template})
    ours, hf = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    reasoning = {"role": "assistant", "content": "Done.", "reasoning_content": "think <hard>"}
    for conversation in CONVERSATIONS + [[{"role": "user", "content": "q"}, reasoning]]:
        for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False, "date_string": "1 Jan 2030"}):
            if template is LLAMA3_TEMPLATE and "tools" in kwargs and conversation[0] is not SYSTEM:
                continue  # this template wants the system turn first when tools are given
            for gen in (True, False):
                assert ours.apply_chat_template(conversation, add_generation_prompt=gen, **kwargs) == \
                    hf.apply_chat_template(conversation, add_generation_prompt=gen, tokenize=False, **kwargs)
    two_calls = dict(TOOL_CALL, tool_calls=TOOL_CALL["tool_calls"] * 2)
    if template is LLAMA3_TEMPLATE:
        with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
            ours.apply_chat_template([{"role": "user", "content": "x"}, two_calls])


def test_named_templates_and_jinja_file(tmp_path, tok_dir):
    named = [{"name": "default", "template": "D{{ messages | length }}"},
             {"name": "tool_use", "template": "T{{ tools | tojson }}"}]
    t = Tokenizer.from_pretrained(with_config(tmp_path, tok_dir, tokenizer_config={"chat_template": named}))
    messages = [{"role": "user", "content": "hi"}]
    assert t.apply_chat_template(messages) == "D1"
    assert t.apply_chat_template(messages, tools=[{"a": "<é>"}]) == 'T[{"a": "<é>"}]'  # no HTML escaping
    (tmp_path / "chat_template.jinja").write_text("J{{ strftime_now('%Y') | length }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages) == "J4"  # the .jinja file wins


def stream(tok, prompt_ids, out_ids, chunk=1, **kwargs):
    """Feed out_ids `chunk` at a time; returns (detokenizer, deltas, the stop hit)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas, hit = [], None
    for i in range(0, len(out_ids), chunk):
        hit = detok.add_tokens(out_ids[i:i + chunk])
        deltas.append(detok.take_delta())
        assert detok.output_text.startswith("".join(deltas))  # never emits what it must take back
        if hit:
            break
    detok.finish()
    deltas.append(detok.take_delta())
    assert "".join(deltas) == detok.output_text
    return detok, deltas, hit


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok, text):
    out = tok.encode(text, add_special_tokens=False) + [1]  # ends with eos, skipped in text
    for prompt in ([], tok.encode("Tell me something:"), tok.encode("other context 😀 ")):
        detok, _, _ = stream(tok, prompt, out)
        # The prompt does not leak into the output; special tokens (even typed as text) are skipped.
        assert detok.output_text == tok.decode(out) == text.replace("<|im_end|>", "")
    detok, _, _ = stream(tok, [], out, skip_special_tokens=False)
    assert detok.output_text == tok.decode(out, skip_special_tokens=False)


def test_emoji_split_across_byte_tokens(tok):
    out = tok.encode("ok 😀!", add_special_tokens=False)
    emoji_ids = tok.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) >= 2  # the 4 UTF-8 bytes are split over byte-level tokens
    _, deltas, _ = stream(tok, tok.encode("Say:"), out)
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas and "".join(deltas) == "ok 😀!"
    # Generation cut mid-character: nothing until finish(), then the lossy text as decode gives it.
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(emoji_ids[:2])
    assert detok.take_delta() == "" and detok.output_text == ""
    detok.finish()
    assert detok.take_delta() == tok.decode(emoji_ids[:2]) == detok.output_text


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_across_token_boundary(tok, include, chunk):
    text = "The answer is forty-two. Thanks for asking."
    out = tok.encode(text, add_special_tokens=False)
    stop = "two. Th"
    assert stop not in tok.convert_ids_to_tokens(out)  # spans tokens
    detok, deltas, hit = stream(tok, [], out, chunk=chunk, stop=["zzz", stop], include_stop_str_in_output=include)
    assert hit == stop
    assert detok.output_text == "The answer is forty-" + (stop if include else "")
    assert detok.add_tokens(tok.encode(" more", add_special_tokens=False)) is None  # late tokens are ignored
    assert detok.output_text == "The answer is forty-" + (stop if include else "")


class CharTokenizer:
    """One token per character (id = code point): how the text is split into calls is the test's choice alone."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(map(chr, ids))


def splits(n: int, max_part: int = 3):
    """Every way to cut range(n) into consecutive parts of 1..max_part."""
    if n == 0:
        yield []
        return
    for k in range(1, min(max_part, n) + 1):
        for rest in splits(n - k, max_part):
            yield [k, *rest]


@pytest.mark.parametrize("text, stops", [
    ("xxabcd", ["abcd", "q"]),  # the longest stop, its first character exactly as far back as one can reach
    ("xyzab", ["ab", "wxyzq"]),  # a short stop, while a longer one sets how far back to look
    ("aabab", ["bab", "aa"]),  # overlapping stops: the one that completes first wins
    ("ab<EN", ["<END>"]),  # never completes: all text comes out, held back only until finish()
])
@pytest.mark.parametrize("include", [False, True])
def test_stops_found_and_text_held_back_however_the_text_is_split(text, stops, include):
    found = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    for parts in splits(len(text)):
        detok = IncrementalDetokenizer(CharTokenizer(), [], stop=stops, include_stop_str_in_output=include)
        deltas, hit, pos = [], None, 0
        for k in parts:
            hit = detok.add_tokens([ord(c) for c in text[pos:pos + k]])
            pos += k
            deltas.append(detok.take_delta())
            assert detok.output_text.startswith("".join(deltas)), (parts, deltas)  # emitted text is final
            if hit:
                break
        detok.finish()
        deltas.append(detok.take_delta())
        if not found:
            assert hit is None and "".join(deltas) == text, parts
        else:
            end, start, stop = found[0]
            assert hit == stop and "".join(deltas) == text[:end if include else start], (parts, deltas)


def test_holdback_only_keeps_possible_stop_prefixes(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["<END>", "xyz"])
    detok.add_tokens(tok.encode("a <b", add_special_tokens=False))
    assert detok.take_delta() == "a <b"  # "<b" cannot start a stop: nothing held back
    detok.add_tokens(tok.encode(" <EN", add_special_tokens=False))
    assert detok.take_delta() == " "  # "<EN" might become "<END>"
    detok.add_tokens(tok.encode("D> tail", add_special_tokens=False))
    assert detok.stop_hit == "<END>" and detok.output_text == "a <b " and detok.take_delta() == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 8191), max_size=40), chunk=st.integers(1, 4), skip=st.booleans(),
       prompt=st.sampled_from(["", "Prompt:", "naïve 😀"]))
def test_random_ids_stream_to_decode(tok, ids, chunk, skip, prompt):
    detok, _, _ = stream(tok, tok.encode(prompt), ids, chunk=chunk, skip_special_tokens=skip)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from("ab <>/ENDé😀"), max_size=40), chunk=st.integers(1, 3),
       stops=st.lists(st.text(st.sampled_from("ab<>/END😀"), min_size=1, max_size=5), min_size=1, max_size=3),
       include=st.booleans())
def test_random_stops_match_reference(tok, text, chunk, stops, include):
    detok, _, hit = stream(tok, [], tok.encode(text, add_special_tokens=False), chunk=chunk, stop=stops,
                           include_stop_str_in_output=include)
    # Reference: the stop that completes first in the character stream (ties: the one starting earlier).
    found = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    if not found:
        assert hit is None and detok.output_text == text
    else:
        end, start, _ = found[0]
        assert detok.output_text == text[:end if include else start]
        assert hit == found[0][2]
