"""Structured output on the demo model (random weights): every sampled document validates, greedy
constrained output does not depend on batching, chunking, the prefix cache or preemption, generation
stops the moment the document is complete, and jump-forward emits the same tokens in fewer steps.

The engine runs in float32 here: token identity across code paths (a forced token's KV is computed in
a multi-token chunk, not by the decode path) is exact in fp32; in bf16 the two paths round differently
and a random-weight model's near-ties can flip, as the reference tests already allow for bf16."""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic_core
import pytest

from twospeed import LLM, SamplingParams
from twospeed.engine.sampling_params import StructuredOutput

NESTED = {"type": "object", "additionalProperties": False, "required": ["user", "ok"], "properties": {
    "user": {"type": "object", "additionalProperties": False, "required": ["id", "role"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "role": {"enum": ["admin", "guest"]}}},
    "ok": {"type": "boolean"}}}
ARRAY = {"type": "object", "additionalProperties": False, "required": ["xs"], "properties": {
    "xs": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
ENUM_NUMBER = {"type": "object", "additionalProperties": False, "required": ["color", "score"], "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "score": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25}}}
PATTERN = {"type": "object", "additionalProperties": False, "required": ["code", "tag"], "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "tag": {"type": "string", "minLength": 1, "maxLength": 6, "pattern": "^[a-z]+$"}}}
SCHEMAS = {"nested": NESTED, "array": ARRAY, "enum_number": ENUM_NUMBER, "pattern": PATTERN}

PROMPTS = ["Return the record as JSON.", "hello", "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", seed=0, dtype="float32")


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM("demo", seed=0)  # the checkpoint's own dtype, for the tests that need no token identity


def _greedy(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=96, temperature=0, structured=StructuredOutput(json=schema, **kw))


def test_64_sampled_documents_per_schema_all_validate(llm_bf16):
    llm = llm_bf16
    names, n = list(SCHEMAS), 64
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=i, structured=SCHEMAS[name])
              for name in names for i in range(n)]
    outs = llm.generate([PROMPTS[i % 2] for i in range(len(params))], params)
    for k, out in enumerate(outs):
        name = names[k // n]
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    # Random weights at temperature 1 explore: the documents of a schema are not all the same.
    assert all(len({o.text for o in outs[k * n:(k + 1) * n]}) > 10 for k in range(len(names)))


SUM = r"\([0-9]{1,2}(\+[0-9]{1,2})*\)"  # the Lark grammar below, as a regex
SUM_PREFIX = r"(\(([0-9]{1,2}(\+[0-9]{1,2})*(\+|\))?)?)?"  # every prefix of a SUM sentence


def test_regex_choice_grammar_and_any_object(llm_bf16):
    llm = llm_bf16
    specs = [StructuredOutput(regex=r"[a-c]{3}-[0-9]{2}"), StructuredOutput(choice=["yes", "no", "maybe so"]),
             StructuredOutput(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'),
             StructuredOutput(grammar='root ::= "ab" [0-9] [0-9]?'), StructuredOutput(json_object=True)]
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured=s) for s in specs for i in range(8)]
    outs = llm.generate(["pick one"] * len(params), params)
    for p, out in zip(params, outs):
        s = p.structured
        if s.regex is not None:
            assert re.fullmatch(s.regex, out.text), out.text
        elif s.choice is not None:
            assert out.text in s.choice
        elif s.grammar is not None and "::=" in s.grammar:
            assert re.fullmatch(r"ab[0-9][0-9]?", out.text), out.text
        elif s.grammar is not None:
            if out.finish_reason == "stop":
                assert re.fullmatch(SUM, out.text), out.text
            else:  # cut by max_tokens: what came out must still be the start of a sentence of the grammar
                assert out.finish_reason == "length" and re.fullmatch(SUM_PREFIX, out.text), out.text
        elif out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:
            assert out.finish_reason == "length" and is_json_object_prefix(out.text), out.text


def is_json_object_prefix(text: str) -> bool:
    """Some JSON object starts with `text`: a complete object with nothing after it, or an incomplete one that a
    partial JSON parser (pydantic's, apart from llguidance) reads as an object without an error."""
    if not text.startswith("{"):
        return False
    try:
        value, end = json.JSONDecoder().raw_decode(text)
        return end == len(text) and isinstance(value, dict)
    except json.JSONDecodeError:
        pass
    try:
        return isinstance(pydantic_core.from_json(text, allow_partial="trailing-strings"), dict)
    except ValueError:
        return False


def test_prefix_checks():
    for good in ["", "(", "(1", "(12", "(1+", "(1+23", "(1+2)"]:
        assert re.fullmatch(SUM_PREFIX, good), good
    for bad in ["1", "()", "(123", "(1+)", "(1++", "(1)2", "(+"]:
        assert not re.fullmatch(SUM_PREFIX, bad), bad
    for good in ['{', '{"a', '{"a":', '{"a":[1,{"b":tr', '{"a":"x\\u12', '{"a":1}', '{"a":-']:
        assert is_json_object_prefix(good), good
    for bad in ['', '[1', '{"a" 1', '{]', '{"a":1}}', '{"a":nx', '{"a":01', '{"a":"\\q']:
        assert not is_json_object_prefix(bad), bad


def test_greedy_constrained_output_independent_of_batch_chunks_cache_and_preemption(llm):
    alone = [llm.generate(p, _greedy(NESTED))[0] for p in PROMPTS]
    # A mixed batch: constrained and unconstrained requests in the same steps, prompts chunked 8 tokens at a
    # time, and a pool so small the engine must preempt (and recompute) running requests.
    mixed = LLM("demo", dtype="float32", max_num_batched_tokens=8, block_size=4, num_gpu_blocks=24)
    long_prompt = "Once upon a time " * 8
    prompts = [long_prompt, *PROMPTS, long_prompt, PROMPTS[0]]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), _greedy(NESTED), _greedy(NESTED),
              _greedy(NESTED), SamplingParams(max_tokens=30, temperature=0.8, seed=3), _greedy(NESTED)]
    outs = mixed.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0  # the pool was too small: someone recomputed
    for a, b in zip(alone + alone[:1], outs[1:4] + outs[5:]):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish_reason == "stop"
    # The prefix cache: a second run of the same prompt is served from cached blocks and emits the same tokens.
    again = llm.generate(PROMPTS[2], _greedy(NESTED))[0]
    assert again.bill.cached_tokens > 0 and again.token_ids == alone[2].token_ids


def test_stop_on_complete_ends_at_the_shortest_document(llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    out = llm.generate("answer in JSON", SamplingParams(max_tokens=2048, temperature=0, structured=schema))[0]
    shortest = len(llm.tokenizer.encode('{"ok":true,"n":0}', add_special_tokens=False))
    assert out.finish_reason == "stop" and out.stop_reason is None
    jsonschema.validate(json.loads(out.text), schema)
    assert len(out.token_ids) <= shortest + 3  # a few tokens at most: a longer boolean, one digit
    assert out.bill.output_tokens == len(out.token_ids) and 0 < out.bill.forced_tokens < out.bill.output_tokens
    # It stopped on the grammar, not on an EOS it had to spend one more forward pass to sample.
    assert not set(out.token_ids) & llm.engine.eos_token_ids
    assert out.clock.decode_steps == len(out.token_ids) - 1 - out.bill.forced_tokens


def test_jump_forward_same_tokens_fewer_forward_passes(llm):
    def run(jump_forward: bool):
        engine = llm.engine
        reqs = [engine.add_request(None, p, _greedy(ENUM_NUMBER, jump_forward=jump_forward)) for p in PROMPTS]
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return reqs, steps

    with_jf, steps_jf = run(True)
    without, steps_plain = run(False)
    for a, b in zip(with_jf, without):
        assert a.output_token_ids == b.output_token_ids
        assert a.bill.forced_tokens > 0 and b.bill.forced_tokens == 0
        assert a.clock.decode_steps + a.bill.forced_tokens == b.clock.decode_steps
        assert a.grammar.num_consumed == len(a.output_token_ids)  # the matcher mirrors the tokens exactly
    assert steps_jf < steps_plain


def test_seeded_sampling_reproducible_under_batching(llm):
    p = SamplingParams(max_tokens=64, temperature=1.0, seed=7, structured=PATTERN)
    alone = llm.generate("x", p)[0]
    batch = llm.generate(["y", "x", "z"], [SamplingParams(max_tokens=20, temperature=1.0), p,
                                           SamplingParams(max_tokens=64, temperature=1.0, structured=NESTED)])
    assert batch[1].token_ids == alone.token_ids


def test_logprobs_turn_jump_forward_off(llm):
    out = llm.generate("hi", SamplingParams(max_tokens=64, temperature=0, logprobs=2, structured=ARRAY))[0]
    assert out.bill.forced_tokens == 0 and len(out.logprobs) == len(out.token_ids)
    jsonschema.validate(json.loads(out.text), ARRAY)


@pytest.mark.parametrize("spec, message", [
    ({"type": "foo"}, r"invalid JSON schema.*'foo' is not valid"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, r"/nope"),
    ({"type": "string", "pattern": "(("}, r"pattern: '\(\(' is not a 'regex'"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, r"minimum \(5\) is greater than maximum \(1\)"),
    (StructuredOutput(regex="[a-"), r"regex"),
    (StructuredOutput(grammar="start: undefined_rule"), r"unknown name"),
])
def test_bad_grammars_rejected_before_scheduling(llm, spec, message):
    engine = llm.engine
    free = engine.kv.num_free_blocks
    good = SamplingParams(max_tokens=8, structured=NESTED)
    with pytest.raises(ValueError, match=message):
        llm.generate(["fine", "bad"], [good, SamplingParams(max_tokens=8, structured=spec)])
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == free  # nothing half-admitted


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty"), ({"json": "{nope"}, "not valid JSON"), ({"json": [1]}, "object or a boolean"),
])
def test_structured_output_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**kwargs)


def test_spec_rejections_in_sampling_params():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=NESTED)
    with pytest.raises(ValueError, match="StructuredOutput or a JSON schema"):
        SamplingParams(structured="[a-z]+")


def test_compiled_grammars_cached_by_content(llm):
    grammars = llm.engine.grammars
    reordered = json.loads(json.dumps(ARRAY))
    reordered = dict(reversed(list(reordered.items())))  # same content, other key order
    llm.generate("a", SamplingParams(max_tokens=32, structured=ARRAY))
    hits, misses = grammars.hits, grammars.misses
    llm.generate("b", SamplingParams(max_tokens=32, structured=reordered))
    assert (grammars.hits, grammars.misses) == (hits + 1, misses)


def test_a_grammar_failure_ends_only_that_request(llm):
    engine = llm.engine
    broken = engine.add_request(None, "a", SamplingParams(max_tokens=16, temperature=0, structured=NESTED))
    healthy = engine.add_request(None, "a", SamplingParams(max_tokens=64, temperature=0, structured=NESTED))
    broken.grammar.accept = lambda token: False  # as if the grammar library hit a parser limit mid-document
    while engine.has_unfinished_requests():
        engine.step()
    assert broken.finish_reason == "abort" and broken.stop_reason.startswith("structured output failed")
    assert healthy.finish_reason == "stop" and engine.kv.num_free_blocks == engine.num_blocks


def test_structured_output_needs_a_tokenizer():
    bare = LLM("demo", skip_tokenizer_init=True, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate([1, 2, 3], SamplingParams(structured=NESTED))
    assert not bare.engine.has_unfinished_requests()


def test_a_server_builds_its_grammar_compilers_before_it_is_ready():
    """warm_grammars builds the compiler where there is a tokenizer (and is a no-op where there is none); a
    server's start does it for the engine it serves, so no request pays for llguidance's tokenizer."""
    import asyncio
    import gc

    from twospeed.engine.structured import warm_grammars
    from twospeed.server.app import ServerConfig, build_app

    bare = LLM("demo", skip_tokenizer_init=True, num_gpu_blocks=8).engine
    warm_grammars(bare)
    assert bare._grammars is None
    engine = LLM("demo", num_gpu_blocks=8).engine
    assert engine._grammars is None  # built on first use, in an engine of its own
    app = build_app(engine.config, ServerConfig(), engine=engine)

    async def main():
        async with app.router.lifespan_context(app):
            return engine._grammars

    try:
        built = asyncio.run(main())
    finally:
        gc.unfreeze()  # the server froze this test process's heap at startup
    assert built is not None and built.misses == 0


def test_grammar_state_replays_tokens_into_a_fresh_matcher(llm):
    grammars = llm.engine.grammars
    spec = StructuredOutput(json=NESTED)
    ref = grammars.new_state(spec)
    out = llm.generate("z", SamplingParams(max_tokens=64, temperature=0, structured=spec))[0]
    for t in out.token_ids[:7]:
        assert ref.allowed()[t]
        ref.accept(t)
    state = grammars.new_state(spec)
    state.sync(out.token_ids[:7])
    assert state.num_consumed == 7 and (state.allowed() == ref.allowed()).all()
    state.sync(out.token_ids[:3])  # fewer tokens (as if some were taken back): replayed from the start
    assert state.num_consumed == 3 and not (state.allowed() == ref.allowed()).all()
