"""SamplingParams and StructuredOutput validation at every boundary, without a model: the server turns each of
these errors into a 400, and the engine relies on what passes (no torch here; part of `make mutation`)."""

from __future__ import annotations

import math

import pytest

from twospeed.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams, StructuredOutput


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(max_tokens=None), dict(max_tokens=None, min_tokens=10**6),
    dict(max_tokens=5, min_tokens=5), dict(min_tokens=0),
    dict(temperature=0.0), dict(temperature=1e-9), dict(temperature=1e6),
    dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(logprobs=0), dict(logprobs=None), dict(stop=["x"]),
])
def test_accepted_at_the_boundaries(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(min_tokens=-1), r"min_tokens must be in \[0, max_tokens\], got -1"),
    (dict(max_tokens=5, min_tokens=6), r"min_tokens must be in \[0, max_tokens\], got 6"),
    (dict(temperature=-1e-9), "temperature must be a finite number >= 0"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.0000001), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1 or 0"),
    (dict(min_p=-0.01), r"min_p must be in \[0, 1\], got -0.01"),
    (dict(min_p=1.01), r"min_p must be in \[0, 1\]"),
    (dict(logprobs=-1), "logprobs must be >= 0, got -1"),
    (dict(stop=["a", ""]), "stop strings must be non-empty"),
    (dict(stop=""), "stop strings must be non-empty"),
    (dict(min_tokens=1, structured={"type": "object"}), "min_tokens cannot be combined with structured"),
    (dict(structured="[a-z]+"), "structured must be a StructuredOutput or a JSON schema dict, got str"),
])
def test_rejected_with_the_limit_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalised_forms():
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=7).top_k == 7
    assert SamplingParams(stop="END").stop == ["END"]
    p = SamplingParams(structured={"type": "object"})
    assert isinstance(p.structured, StructuredOutput) and p.structured.json == {"type": "object"}
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    d = SamplingParams()
    assert (d.max_tokens, d.min_tokens, d.temperature, d.top_k, d.top_p, d.min_p) == (16, 0, 1.0, 0, 1.0, 0.0)
    assert (d.seed, d.stop, d.stop_token_ids, d.logprobs, d.structured) == (None, [], [], None, None)
    assert (d.ignore_eos, d.include_stop_str_in_output, d.skip_special_tokens) == (False, False, True)
    assert SamplingParams().stop is not SamplingParams().stop  # no list shared between requests


@pytest.mark.parametrize("spec, kind, key", [
    (dict(json={"b": 1, "a": [2]}), "json", ("json", '{"a":[2],"b":1}')),
    (dict(json='{"b": 1, "a": [2]}'), "json", ("json", '{"a":[2],"b":1}')),  # the text is parsed
    (dict(json=True), "json", ("json", "true")),
    (dict(json_object=True), "json_object", ("json_object", "true")),
    (dict(regex="[a-z]+"), "regex", ("regex", "[a-z]+")),
    (dict(choice=("x", "y")), "choice", ("choice", '["x","y"]')),
    (dict(grammar='start: "a"'), "grammar", ("grammar", 'start: "a"')),
])
def test_structured_kind_and_cache_key(spec, kind, key):
    s = StructuredOutput(**spec)
    assert s.kind == kind and s.key() == key and s.jump_forward


@pytest.mark.parametrize("spec, message", [
    (dict(), "exactly one of json, json_object, regex, choice, grammar; got none"),
    (dict(regex="a", grammar="b"), r"exactly one of .*; got \['regex', 'grammar'\]"),
    (dict(json="{nope"), "the JSON schema is not valid JSON"),
    (dict(json=[1]), "a JSON schema is an object or a boolean, got list"),
    (dict(choice=[]), "choice must be a non-empty list of non-empty strings"),
    (dict(choice=["a", ""]), "choice must be a non-empty list"),
    (dict(choice=["a", 3]), "choice must be a non-empty list"),
    (dict(choice="ab"), "choice must be a non-empty list"),
    (dict(regex="  "), "regex must be a non-empty string"),
    (dict(grammar=""), "grammar must be a non-empty string"),
    (dict(grammar=3), "grammar must be a non-empty string"),
])
def test_structured_rejections(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutput(**spec)


def test_structured_choice_is_a_list_copy():
    choices = ("a", "b")
    assert StructuredOutput(choice=choices).choice == ["a", "b"]
