"""No request can hurt another, at the engine: every admission rule (engine/admission.py's table) refuses its
bad value with a ValueError naming the field and allocates nothing; a step that raises anyway fails only the
request that caused it, with the error named, while the others' tokens equal their solo runs; JSON schemas
that admit no finite document are refused and recursive ones that do are served; and a hypothesis fuzz of
random (valid and invalid) requests beside two victims."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twospeed.config import EngineConfig
from twospeed.engine.engine import LLMEngine
from twospeed.engine.json_schema import check_schema, finite_document_problem
from twospeed.engine.sampling_params import SamplingParams, StructuredOutput

MAX_LEN = 128


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=64, max_model_len=MAX_LEN))


def idle(engine: LLMEngine) -> bool:
    return not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_blocks


def run(engine: LLMEngine, requests: dict[str, tuple], until: set[str] | None = None) -> dict:
    """Add (prompt, params) per id, step until the ids in `until` (default: all) finish, abort the rest."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    until = set(requests) if until is None else until
    finals = {}
    for _ in range(4 * MAX_LEN):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if until <= finals.keys():
            break
    for rid in requests:
        engine.abort_request(rid)
    return finals


VICTIMS = {"greedy": ([5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
           "seeded": ("the cache holds blocks", SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True))}


@pytest.fixture(scope="module")
def solo(engine):
    """Each victim's tokens when it runs alone."""
    return {rid: run(engine, {rid: req})[rid].token_ids for rid, req in VICTIMS.items()}


# -- the admission table, row by row ------------------------------------------------------------------------
PARAM_RULES = [  # (SamplingParams kwargs, the field named)
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 1, "structured": {"type": "object"}}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": 1.0}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": ["ok", 3]}, "stop"), ({"stop": ["\ud800"]}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 2.0}, "logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"structured": 5}, "structured"), ({"structured": StructuredOutput.__new__(StructuredOutput)}, None),
]


@pytest.mark.parametrize("kwargs, param", PARAM_RULES, ids=[f"{i}-{p}" for i, (_, p) in enumerate(PARAM_RULES)])
def test_sampling_params_rules(kwargs, param):
    if param is None:  # a StructuredOutput never initialised: refused when used, not a crash
        return
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param, e.value


MODEL_RULES = [  # (prompt, SamplingParams kwargs, priority, the field named, words)
    ([], {}, 0, "prompt", "empty"),
    ([5, 8192], {}, 0, "prompt", "[0, 8192)"),
    ([-1], {}, 0, "prompt", "[0, 8192)"),
    ([5, 6.0], {}, 0, "prompt", "integers"),
    ([5, True], {}, 0, "prompt", "integers"),
    ("not a list", {}, 0, None, None),  # a text prompt is tokenized: fine
    (list(range(5, 5 + MAX_LEN)), {}, 0, "prompt", f"max_model_len is {MAX_LEN}"),
    ([5], {"stop_token_ids": [999999]}, 0, "stop_token_ids", "999999"),
    ([5], {"stop_token_ids": [2**70], "min_tokens": 2}, 0, "stop_token_ids", "[0, 8192)"),
    ([5], {"stop_token_ids": [-1]}, 0, "stop_token_ids", "[0, 8192)"),
    ([5], {"logprobs": 8193}, 0, "logprobs", "8192"),
    ([5], {}, "high", "priority", "integer"),
    ([5], {"structured": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, 0, "structured",
     "finite document"),
    ([5], {"structured": {"type": "foo"}}, 0, "structured", "invalid JSON schema"),
]


@pytest.mark.parametrize("prompt, kwargs, priority, param, words", MODEL_RULES,
                         ids=[f"{i}-{r[3]}" for i, r in enumerate(MODEL_RULES)])
def test_admission_rules_against_the_model(engine, prompt, kwargs, priority, param, words):
    params = SamplingParams(max_tokens=4, **kwargs)
    if words is None:
        engine.add_request("fine", prompt, params, priority=priority)
        engine.abort_request("fine")
        return
    with pytest.raises(ValueError) as e:
        engine.add_request("bad", prompt, params, priority=priority)
    assert words in str(e.value) and getattr(e.value, "param", None) == param, e.value
    assert idle(engine) and "bad" not in engine.scheduler.requests  # nothing allocated, nothing queued


def test_the_issue_request_is_refused_and_the_largest_legal_values_run(engine, solo):
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("x", "hi", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[999999]))
    edge = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[8191, 0], logprobs=8192, top_k=10**9,
                          seed=2**64 - 1, temperature=1e30)
    finals = run(engine, {**VICTIMS, "edge": ([8191, 0], edge)})
    assert finals["edge"].finish_reason == "length" and len(finals["edge"].logprobs[0].top) == 8192
    assert {rid: finals[rid].token_ids for rid in VICTIMS} == solo and idle(engine)


def test_tiny_temperatures_are_greedy(engine):
    prompt = [11, 12, 13]
    greedy = run(engine, {"g": (prompt, SamplingParams(max_tokens=6, temperature=0))})["g"].token_ids
    for t in (1e-40, 1e-8, 9.9e-6):
        out = run(engine, {"t": (prompt, SamplingParams(max_tokens=6, temperature=t))})["t"]
        assert out.token_ids == greedy, t
    assert len(set(greedy)) > 1 or greedy[0] != 0  # a real token, not the underflow's id 0 repeated


# -- a step that raises fails only its culprit ---------------------------------------------------------------
class _Faulty:
    """Wraps a callable; raises when `culprit` is among the requests (or chunks) it is called with."""

    def __init__(self, inner, culprit: str, requests_of):
        self.inner, self.culprit, self.requests_of = inner, culprit, requests_of

    def __getattr__(self, name):  # the sampler's generator, make_generator, ...
        return getattr(self.inner, name)

    def __call__(self, *args):
        if any(r.request_id == self.culprit for r in self.requests_of(*args)):
            raise IndexError("index 999999 is out of bounds (injected)")
        return self.inner(*args)


@pytest.mark.parametrize("where", ["sampler", "runner", "update"])
def test_a_failing_step_fails_only_the_request_that_caused_it(engine, solo, where, monkeypatch):
    if where == "sampler":
        monkeypatch.setattr(engine, "sampler", _Faulty(engine.sampler, "culprit", lambda logits, reqs: reqs))
    elif where == "runner":
        monkeypatch.setattr(engine.runner, "execute",
                            _Faulty(engine.runner.execute, "culprit", lambda chunks, kv: [c.request for c in chunks]))
    before = engine.num_step_failures
    culprit = ([20, 21, 22], SamplingParams(max_tokens=8, ignore_eos=True))
    requests = {**VICTIMS, "culprit": culprit}
    for rid, (prompt, params) in requests.items():
        req = engine.add_request(rid, prompt, params)
        if where == "update" and rid == "culprit":
            req.detokenizer.add_tokens = _Faulty(req.detokenizer.add_tokens, "culprit", lambda ids: [req])
    finals = _step_all(engine, set(requests))
    bad = finals["culprit"]
    assert bad.finish_reason == "error" and "IndexError" in bad.error and "injected" in bad.error
    assert {rid: finals[rid].token_ids for rid in VICTIMS} == solo
    assert all(finals[rid].error is None and finals[rid].finish_reason == "length" for rid in VICTIMS)
    assert engine.num_step_failures == before + 1 and idle(engine)


@pytest.fixture(scope="module")
def spec_engine():
    """Speculating on every step it can (ngram over repeats, no fallback): verify rows in the failing steps."""
    return LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=64, max_model_len=MAX_LEN, spec_method="ngram",
                                              prompt_lookup_min=1, spec_auto_fallback=False))


SPEC_VICTIMS = {"greedy": ([5, 6, 7, 5, 6, 7, 5, 6, 7, 5], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
                "seeded": ([9, 8, 9, 8, 9, 8, 9], SamplingParams(max_tokens=12, temperature=0.05, seed=7,
                                                             ignore_eos=True))}  # sampled, near-greedy: repeats


@pytest.mark.parametrize("where", ["verify", "runner"])
def test_a_failing_verify_step_fails_only_its_culprit(spec_engine, where, monkeypatch):
    """The victims' drafts are verified in the steps that raise; isolation re-runs by halves (forward) and request
    by request over each one's verify rows (sampling): the victims' tokens and traces equal their solo runs."""
    engine = spec_engine
    solo = {rid: run(engine, {rid: req})[rid] for rid, req in SPEC_VICTIMS.items()}
    assert all(o.spec.proposed for o in solo.values()), "no drafts: the test would check plain steps only"
    if where == "verify":  # the culprit's rows raise in a verify step, and alone (its re-run has no drafts) too
        monkeypatch.setattr(engine.sampler, "verify", _Faulty(engine.sampler.verify, "culprit",
                                                              lambda logits, reqs, drafts: reqs))
        monkeypatch.setattr(engine, "sampler", _Faulty(engine.sampler, "culprit", lambda logits, reqs: reqs))
    else:
        monkeypatch.setattr(engine.runner, "execute",
                            _Faulty(engine.runner.execute, "culprit", lambda chunks, kv: [c.request for c in chunks]))
    culprit = ([1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
    finals = run(engine, {**SPEC_VICTIMS, "culprit": culprit})
    assert finals["culprit"].finish_reason == "error" and "injected" in finals["culprit"].error
    for rid in SPEC_VICTIMS:
        assert finals[rid].token_ids == solo[rid].token_ids and finals[rid].error is None
        assert finals[rid].spec.accepted == solo[rid].spec.accepted
    assert idle(engine)


def _step_all(engine: LLMEngine, ids: set[str]) -> dict:
    finals = {}
    while ids - finals.keys():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_batch_that_fails_only_together_is_rerun_in_halves(engine, solo, monkeypatch):
    """No single request is to blame (say the whole batch ran out of memory): the halves run, nobody fails."""
    inner = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute",
                        lambda chunks, kv: (_ for _ in ()).throw(MemoryError("batch too big")) if len(chunks) > 1
                        else inner(chunks, kv))
    finals = run(engine, dict(VICTIMS))
    assert {rid: finals[rid].token_ids for rid in VICTIMS} == solo and idle(engine)


# -- JSON schemas: a finite document, or a 400 ----------------------------------------------------------------
NODE = {"type": "object", "required": ["value"], "additionalProperties": False,
        "properties": {"value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}
TREE = {"type": "object", "required": ["name", "children"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 4},
                       "children": {"type": "array", "items": {"$ref": "#"}}}}
FINITE = [TREE, {"$defs": {"node": NODE}, "$ref": "#/$defs/node"}, {"type": "object"}, True,
          {"type": ["object", "null"], "required": ["a"], "properties": {"a": {"$ref": "#"}}},  # null stops it
          {"required": ["a"], "properties": {"a": {"$ref": "#"}}},  # no type: a number satisfies it
          {"type": "array", "minItems": 2, "prefixItems": [{"type": "integer"}], "items": {"enum": [1]}}]
INFINITE = [
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}}, "#"),
    ({"$defs": {"a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/b"}},
                "b": {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/a"}}}},
      "$ref": "#/$defs/a"}, "#/$defs/"),
    ({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, "#"),
    (False, "schema false"),
    ({"type": "object", "required": ["a"], "properties": {"a": False}}, "schema false"),
]


@pytest.mark.parametrize("schema", FINITE, ids=range(len(FINITE)))
def test_schemas_with_a_finite_document_pass(schema):
    assert finite_document_problem(schema) is None
    check_schema(schema)


@pytest.mark.parametrize("schema, words", INFINITE, ids=range(len(INFINITE)))
def test_schemas_without_a_finite_document_are_refused(engine, schema, words):
    assert words in finite_document_problem(schema)
    with pytest.raises(ValueError, match="finite document|admits no document"):
        engine.add_request("inf", [5], SamplingParams(max_tokens=4, structured=StructuredOutput(json=schema)))
    assert idle(engine)


def test_a_recursive_schema_is_served(engine):
    """The compiled grammar takes a nested document of the recursive schema, and generation runs."""
    doc = '{"name":"a","children":[{"name":"b","children":[]},{"name":"c","children":[{"name":"d","children":[]}]}]}'
    matcher = engine.grammars.compile(StructuredOutput(json=TREE))
    ids = engine.tokenizer.encode(doc, add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    out = run(engine, {"tree": ("a tree", SamplingParams(max_tokens=48, temperature=0, structured=TREE))})["tree"]
    assert out.finish_reason in ("stop", "length") and out.text.startswith('{"name":"')
    if out.finish_reason == "stop":
        json.loads(out.text)


# -- the fuzz: random requests beside two victims ---------------------------------------------------------
SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer"}}}, TREE, {"type": "string", "maxLength": 3}]
VALID = {  # the edges of every field's legal range
    "max_tokens": st.one_of(st.none(), st.integers(1, 40), st.just(10**12)),
    "min_tokens": st.integers(0, 8),
    "temperature": st.one_of(st.floats(0, 5), st.sampled_from([0.0, 1e-40, 9.9e-6, 1e-5, 1e30])),
    "top_k": st.one_of(st.integers(-1, 12), st.just(10**9)),
    "top_p": st.one_of(st.floats(1e-6, 1), st.just(1.0)),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "stop": st.lists(st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, 2, 8191]) | st.integers(0, 8191), max_size=3),
    "logprobs": st.one_of(st.none(), st.integers(0, 3), st.just(8192)),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "structured": st.one_of(st.none(), st.sampled_from(SCHEMAS)),
}
INVALID = st.sampled_from([  # one field set to a value a rule refuses
    ("max_tokens", 0), ("max_tokens", -2), ("min_tokens", -1), ("min_tokens", 10**6), ("temperature", -1.0),
    ("temperature", math.nan), ("temperature", math.inf), ("top_k", -3), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", 2.0), ("seed", 2**65), ("stop", [""]), ("stop", ["\ud800"]), ("stop_token_ids", [999999]),
    ("stop_token_ids", [2**70]), ("stop_token_ids", [-5]), ("logprobs", 9000), ("logprobs", -1),
    ("structured", {"$ref": "#"}), ("structured", {"type": "bogus"}), ("ignore_eos", 1)])
PROMPTS = st.one_of(st.lists(st.integers(0, 8191), min_size=1, max_size=24), st.text(min_size=1, max_size=40),
                    st.lists(st.integers(0, 8191), min_size=MAX_LEN - 2, max_size=MAX_LEN - 1))
BAD_PROMPTS = st.sampled_from([[], [8192], [-1], [5, 2**40], list(range(MAX_LEN))])


@st.composite
def attackers(draw) -> tuple[dict, list | str, int | str]:
    """(SamplingParams kwargs, prompt, priority): legal values at their edges, and sometimes one illegal one."""
    kwargs = draw(st.fixed_dictionaries({}, optional=VALID))
    if kwargs.get("structured") is not None:  # min_tokens and a grammar exclude each other
        kwargs.pop("min_tokens", None)
    if kwargs.get("min_tokens", 0) > (kwargs.get("max_tokens") or 16):
        kwargs["min_tokens"] = kwargs.get("max_tokens") or 16
    prompt = draw(PROMPTS)
    priority = draw(st.integers(-5, 5))
    kind = draw(st.sampled_from(["valid", "valid", "bad field", "bad prompt", "bad priority"]))
    if kind == "bad field":
        field, value = draw(INVALID)
        kwargs[field] = value
    elif kind == "bad prompt":
        prompt = draw(BAD_PROMPTS)
    elif kind == "bad priority":
        priority = "urgent"
    return kwargs, prompt, priority


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(attacker=attackers())
def test_fuzz_no_request_changes_a_victim_or_leaks_a_block(engine, solo, attacker):
    kwargs, prompt, priority = attacker
    for rid, (p, victim_params) in VICTIMS.items():
        engine.add_request(rid, p, victim_params)
    try:
        engine.add_request("attacker", prompt, SamplingParams(**kwargs), priority=priority)
    except ValueError as e:  # refused when built or at admission, naming the field
        assert getattr(e, "param", None) or "structured output" in str(e) or "JSON schema" in str(e), e
    finals = _step_all(engine, set(VICTIMS))
    assert {rid: finals[rid].token_ids for rid in VICTIMS} == solo
    attacker = finals.get("attacker")
    assert attacker is None or attacker.finish_reason != "error", attacker.error  # admission let a bad one in
    engine.abort_request("attacker")
    assert idle(engine)
