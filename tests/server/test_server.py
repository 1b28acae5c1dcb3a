"""The HTTP server, end to end: a real `twospeed serve` process on a free loopback port, driven by the
official openai client and by raw httpx; outputs compared with LLM.generate on the same demo model;
/metrics parsed with prometheus_client; schemathesis over the server's own OpenAPI document; a
bounded soak. All traffic goes to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time

import httpx
import pytest

from server_harness import ENGINE, ServerProcess, metric_sum, parse_metrics, scrape, sse_events, wait_idle  # noqa: F401
from twospeed import LLM, SamplingParams

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

SLOS = ["drafting:ttft_p99=30s,itl_p99=10s", "strict:ttft=1us"]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(*[a for s in SLOS for a in ("--slo", s)], "--max-waiting", "2000")
    yield srv
    srv.stop_clean()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    return LLM("demo", **ENGINE)


# -- OpenAI API, checked against LLM.generate -----------------------------------------------------
PROMPTS = ["The quick brown fox", "Explain the prefill phase of a transformer"]


def test_health_and_models(server, client):
    assert httpx.get(f"{server.base}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=1234)],
                         ids=["greedy", "seeded"])
def test_completions_match_llm_generate(client, reference, sampling):
    params = SamplingParams(max_tokens=12, **sampling)
    expected = reference.generate(PROMPTS, params)
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                      extra_body={"return_token_ids": True}, **sampling)
        choice = r.choices[0]
        assert choice.token_ids == ref.token_ids
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        stream = client.completions.create(model="demo", prompt=prompt, max_tokens=12, stream=True,
                                           extra_body={"return_token_ids": True}, **sampling)
        ids, text = [], ""
        for chunk in stream:
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
        assert ids == ref.token_ids
        assert text == ref.text


def test_sampling_controls_match_llm_generate(client, reference):
    """OpenAI's logit_bias and penalties and vLLM's repetition_penalty, served: the tokens LLM.generate gives with
    the same parameters (whose sampler is checked against a reference in tests/engine/test_sampler.py), different from
    the plain answer, and a +100 bias takes every greedy token."""
    plain = reference.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    controls = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(repetition_penalty=1.8),
                dict(logit_bias={plain.token_ids[0]: -100.0, plain.token_ids[1]: -50.0})]
    for extra in controls:
        ref = reference.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                             **extra))[0]
        assert ref.token_ids != plain.token_ids, extra
        body = {**extra, "logit_bias": {str(k): v for k, v in extra["logit_bias"].items()}} if "logit_bias" in extra \
            else dict(extra)
        openai_fields = {k: body.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias") if k in body}
        r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True, **body},
                                      **openai_fields)
        assert r.choices[0].token_ids == ref.token_ids, extra
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=6, temperature=0.0,
                                  logit_bias={"777": 100}, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].token_ids == [777] * 6


def test_vllm_guided_fields_constrain_the_output(client):
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=20, temperature=1.0, seed=3, n=4,
                                  extra_body={"guided_choice": ["prefill", "decode"]})
    assert {c.text for c in r.choices} <= {"prefill", "decode"}
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       temperature=1.0, seed=4, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer", "minimum": 0,
                                                                       "maximum": 99}}}
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=30, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"json": schema}})
    assert set(json.loads(r.choices[0].text)) == {"n"}


def test_chat_matches_llm_generate(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What sets TTFT?"}]
    tok = reference.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
        [ref] = reference.generate([prompt_ids], SamplingParams(max_tokens=10, **sampling))
        r = client.chat.completions.create(model="demo", messages=messages, max_completion_tokens=10,
                                           extra_body={"return_token_ids": True}, **sampling)
        assert r.choices[0].token_ids == ref.token_ids
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(prompt_ids)
        # The streamed request now hits the prefix cache: its last prompt token runs as a one-token chunk (the
        # decode path), so in bf16 its logits may round differently from a full prefill's. The reference
        # repeats the request to be in the same cache state.
        [ref] = reference.generate([prompt_ids], SamplingParams(max_tokens=10, **sampling))
        stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=10, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True}, **sampling)
        chunks = list(stream)
        ids = [t for c in chunks for ch in c.choices for t in (ch.token_ids or [])]
        assert ids == ref.token_ids
        assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == ref.text
        assert chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.completion_tokens == len(ref.token_ids)
        # the same messages just ran: every full block of the prompt is a hit (the last token is always computed)
        bs = ENGINE["block_size"]
        assert usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // bs * bs


def test_usage_cached_tokens_and_twospeed_object(server):
    prompt = "latency throughput prefill decode token cache block schedule " * 8  # several full KV blocks
    body = {"model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    sent = time.monotonic()
    second = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    round_trip_ms = (time.monotonic() - sent) * 1e3
    assert first.status_code == second.status_code == 200
    u1, u2 = first.json()["usage"], second.json()["usage"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    bs = ENGINE["block_size"]
    assert u2["prompt_tokens"] > 2 * bs and cached == (u2["prompt_tokens"] - 1) // bs * bs  # every full block
    ts = second.json()["twospeed"]
    assert ts["bill"] == {"prompt_tokens": u2["prompt_tokens"], "cached_tokens": cached,
                          "prefilled_tokens": u2["prompt_tokens"] - cached, "output_tokens": 4, "recomputed_tokens": 0,
                          "forced_tokens": 0, "spec_proposed": 0, "spec_accepted": 0, "spec_rejected": 0}
    clock = ts["clock"]
    # The clock's own identities, and it fits inside what the client saw (nothing else was running).
    assert clock["prefill_ms"] > 0 and clock["ttft_ms"] >= clock["queue_ms"] + clock["prefill_ms"] - 1e-3
    assert clock["ttft_ms"] < clock["ttlt_ms"] <= round_trip_ms
    assert (clock["decode_steps"], clock["interfered_steps"]) == (3, 0)  # 4 tokens: 1 from the prefill, 3 decodes
    assert clock["longest_interfered_step_ms"] == 0
    assert math.isclose(clock["tpot_ms"], (clock["ttlt_ms"] - clock["ttft_ms"]) / 3, abs_tol=2e-3)
    itl = clock["itl_ms"]
    assert set(itl) == {"p50", "p99", "max"} and 0 < itl["p50"] <= itl["p99"] <= itl["max"]
    assert itl["max"] <= clock["ttlt_ms"] - clock["ttft_ms"] + 1e-3  # one of the 3 gaps the decode spans
    timing = dict(re.findall(r"(\w+);dur=([\d.]+)", second.headers["server-timing"]))
    assert set(timing) == {"queue", "prefill", "decode"}
    assert math.isclose(float(timing["queue"]), clock["queue_ms"], abs_tol=1e-3)
    assert math.isclose(float(timing["decode"]), clock["ttlt_ms"] - clock["ttft_ms"], abs_tol=2e-3)


def test_stream_chunks_carry_token_counts_and_emit_times(server):
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "stop": ["zzzz-never"]}
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    times = []
    for c in events[:-1]:  # every data chunk says how many tokens it holds and when each was emitted
        assert c["twospeed"]["num_tokens"] == len(c["twospeed"]["emit_times"])
    for c in chunks:
        ts = c["twospeed"]
        assert ts["num_tokens"] == len(c["choices"][0]["token_ids"]) == len(ts["emit_times"])
        times += ts["emit_times"]
    assert len(times) == 8 and times == sorted(times)
    assert abs(times[0] - time.time()) < 60  # Unix seconds
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["twospeed"]["bill"]["output_tokens"] == 8 and "clock" in final["twospeed"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    # "Once upon a time" is shorter than a block: nothing can be served from the cache
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] < ENGINE["block_size"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage_chunk["twospeed"]["bill"]["cached_tokens"] == 0
    assert usage_chunk["twospeed"]["bill"]["output_tokens"] == 8
    # Without include_usage the last data chunk before [DONE] still carries the clock and the bill.
    body.pop("stream_options")
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and "bill" in events[-2]["twospeed"] and "usage" not in events[-2]


def test_n_logprobs_and_seed(client, reference):
    r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0,
                                  seed=42, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    again = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0,
                                      seed=42)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    ts = r.model_extra["twospeed"]
    assert ts["bill"]["output_tokens"] == 18 and len(ts["choices"]) == 3
    assert r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == len(reference.tokenizer.encode("Once upon a time"))
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    assert content[0].bytes == list(content[0].token.encode())
    # Streamed chat logprobs and several choices.
    chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, n=2, logprobs=True, top_logprobs=1, stream=True))
    per_choice = {0: 0, 1: 0}
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs:
                per_choice[ch.index] += len(ch.logprobs.content)
    assert per_choice == {0: 3, 1: 3}


def test_stop_strings(client, reference):
    [ref] = reference.generate(["Once upon a time"], SamplingParams(max_tokens=16, temperature=0.8, seed=5))
    stop = ref.text[len(ref.text) // 2:][:3]
    assert stop and stop in ref.text
    r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=5,
                                  stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.text[:ref.text.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop


def test_prompt_as_token_ids_and_batch(client, reference):
    ids = reference.tokenizer.encode("The quick brown fox")
    [ref] = reference.generate([ids], SamplingParams(max_tokens=5, temperature=0))
    r = client.completions.create(model="demo", prompt=[ids, ids], max_tokens=5, temperature=0, n=2,
                                  extra_body={"return_token_ids": True})
    assert len(r.choices) == 4 and all(c.token_ids == ref.token_ids for c in r.choices)
    assert r.usage.prompt_tokens == 2 * len(ids)


def test_echo(client):
    r = client.completions.create(model="demo", prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Echo me")


def test_prompt_logprobs_are_the_engines(client, reference):
    """vLLM's prompt_logprobs (completions: per choice; chat: once per response) and OpenAI's echo with logprobs
    carry the engine's own prompt logprobs, token for token."""
    ids = reference.tokenizer.encode("The prefill phase reads the whole prompt")
    [ref] = reference.generate([ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=1))
    r = client.completions.create(model="demo", prompt=ids, max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for entry, lp in zip(got[1:], ref.prompt_logprobs[1:]):
        assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
        assert entry[str(lp.token_id)]["rank"] == lp.rank
        assert {k for k in entry} == {str(t) for t in lp.top} | {str(lp.token_id)}
    echo = client.completions.create(model="demo", prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lps = echo.choices[0].logprobs
    assert len(lps.tokens) == len(ids) + 3 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:len(ids)] == pytest.approx([lp.logprob for lp in ref.prompt_logprobs[1:]], abs=1e-5)
    assert lps.token_logprobs[len(ids):] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)
    assert "".join(lps.tokens[len(ids):]) == echo.choices[0].text.removeprefix(reference.tokenizer.decode(ids))
    assert all(len(top) <= 2 for top in lps.top_logprobs[1:])  # the n asked for, plus the token itself
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    prompt = chat.model_extra["prompt_logprobs"]
    assert prompt[0] is None and all(len(e) == 1 for e in prompt[1:])
    assert len(prompt) == chat.usage.prompt_tokens


# -- bad input: OpenAI-style 400s, and the server keeps serving -----------------------------------
BAD = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", b"", None),
    ("completions", {"model": "no-such-model", "prompt": "hi"}, "model"),
    ("completions", {"model": "demo"}, "prompt"),
    ("chat/completions", {"model": "demo"}, "messages"),
    ("chat/completions", {"model": "demo", "messages": []}, "messages"),
    ("chat/completions", {"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"model": "demo", "messages": "hello"}, "messages"),
    ("completions", {"model": "demo", "prompt": 5}, "prompt"),
    ("completions", {"model": "demo", "prompt": ""}, "prompt"),
    ("completions", {"model": "demo", "prompt": []}, "prompt"),
    ("completions", {"model": "demo", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"model": "demo", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": "demo", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("completions", {"model": "demo", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", b'{"model": "demo", "prompt": "hi", "temperature": NaN}', "temperature"),
    ("completions", b'{"model": "demo", "prompt": "hi", "temperature": Infinity}', "temperature"),
    ("completions", {"model": "demo", "prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"model": "demo", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"model": "demo", "prompt": "hi", "n": 0}, "n"),
    ("completions", {"model": "demo", "prompt": "hi", "n": 1000}, "n"),
    ("completions", {"model": "demo", "prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"model": "demo", "prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"model": "demo", "prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"model": "demo", "prompt": "hi", "stop": 3}, "stop"),
    ("completions", {"model": "demo", "prompt": "hi", "min_tokens": 9, "max_tokens": 2}, None),
    ("completions", {"model": "demo", "prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"model": "demo", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"model": "demo", "prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"model": "demo", "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"model": "demo", "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"model": "demo", "prompt": "hi", "logit_bias": {"five": 10}}, "logit_bias"),
    ("completions", {"model": "demo", "prompt": "hi", "logit_bias": {"99999999": 10}}, "logit_bias"),
    ("completions", {"model": "demo", "prompt": "hi", "min_tokens": 10**23, "max_tokens": None}, "min_tokens"),
    ("completions", {"model": "demo", "prompt": "hi", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("completions", {"model": "demo", "prompt": "hi", "prompt_logprobs": 99}, "prompt_logprobs"),
    ("completions", {"model": "demo", "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    # a number Python cannot even convert (over 4,300 digits) is out of range like any other
    ("completions", b'{"model": "demo", "prompt": "hi", "max_tokens": ' + b"9" * 5001 + b"}", "max_tokens"),
    ("chat/completions", b'{"model": "demo", "messages": [{"role": "user", "content": "x"}], "seed": -'
     + b"9" * 5001 + b"}", "seed"),
    ("completions", {"model": "demo", "prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("completions", {"model": "demo", "prompt": "hi", "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ("completions", {"model": "demo", "prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex"),
    ("completions", {"model": "demo", "prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("completions", {"model": "demo", "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("completions", {"model": "demo", "prompt": "hi", "best_of": 3}, "best_of"),
    ("completions", {"model": "demo", "prompt": "hi", "suffix": "tail"}, "suffix"),
    ("completions", {"model": "demo", "prompt": [5, 10**9]}, "prompt"),
    ("completions", {"model": "demo", "prompt": [-1]}, "prompt"),
    ("completions", {"model": "demo", "prompt": "hi", "lane": "no spaces allowed"}, "lane"),
    ("chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    # tools and response_format are served (tests/server/test_server_structured.py); malformed ones are 400s.
    ("chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
    ("chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                              "type": "foo"}}}}, "response_format"),
    ("chat/completions", {"model": "demo", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("chat/completions", {"model": "demo", "messages": [{"role": "user", "content": None}]}, "messages"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{p or 'body'}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_gets_openai_400(server, path, body, param):
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        kwargs = {"json": body}
    r = httpx.post(f"{server.url}/{path}", timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].split(".")[0] == param, error


def test_prompt_too_long_names_both_numbers(server, reference):
    prompt = "cache " * 400
    n = len(reference.tokenizer.encode(prompt))
    r = httpx.post(f"{server.url}/completions", json={"model": "demo", "prompt": prompt}, timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert str(n) in message and str(ENGINE["max_model_len"]) in message
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_unknown_route_and_method(server):
    assert httpx.get(f"{server.url}/nothing").status_code == 404
    r = httpx.get(f"{server.url}/completions")
    assert r.status_code == 405 and "error" in r.json()


# -- lanes and SLOs -------------------------------------------------------------------------------
def test_lanes_and_slo_verdicts(server):
    def post(lane_body=None, lane_header=None):
        body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 3}
        if lane_body:
            body["lane"] = lane_body
        headers = {"x-twospeed-lane": lane_header} if lane_header else {}
        r = httpx.post(f"{server.url}/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["twospeed"]

    def step_target() -> float:  # the target of the last step that carried decodes (set before its outputs go)
        return metric_sum(scrape(server.base), "twospeed_step_target_seconds")

    assert post()["lane"] == "default"
    assert step_target() == pytest.approx(0.050)  # no lane SLO: --target-step-ms's default
    drafting = post(lane_header="drafting")
    assert drafting["lane"] == "drafting" and drafting["slo"]["met"] is True
    assert step_target() == pytest.approx(10 * 0.8)  # its itl_p99=10s x itl_objective_share
    strict = post(lane_body="strict", lane_header="drafting")  # the body wins over the header
    assert strict["lane"] == "strict"
    assert step_target() == 0.0  # an SLO with no ITL objective: steps beside it are not sized by time
    assert strict["slo"]["met"] is False and strict["slo"]["missed"] == ["ttft"]
    assert strict["slo"]["cause"] in ("queue", "prefill")


# -- metrics ---------------------------------------------------------------------------------------
METRIC_NAMES = {  # the names README lists, and nothing else
    "twospeed_time_to_first_token_seconds": "histogram", "twospeed_inter_token_latency_seconds": "histogram",
    "twospeed_request_queue_time_seconds": "histogram", "twospeed_request_prefill_time_seconds": "histogram",
    "twospeed_request_decode_time_seconds": "histogram", "twospeed_e2e_request_latency_seconds": "histogram",
    "twospeed_step_tokens": "histogram", "twospeed_prompt_tokens_total": "counter",
    "twospeed_generation_tokens_total": "counter", "twospeed_lane_overflow_total": "counter",
    "twospeed_prefix_cache_queries_total": "counter",
    "twospeed_prefix_cache_hits_total": "counter", "twospeed_num_preemptions_total": "counter",
    "twospeed_slo_requests_total": "counter", "twospeed_num_requests_running": "gauge",
    "twospeed_num_requests_waiting": "gauge", "twospeed_kv_cache_usage_ratio": "gauge",
    "twospeed_kv_cache_cached_blocks": "gauge", "twospeed_engine_step_failures_total": "counter",
    "twospeed_forced_tokens_total": "counter", "twospeed_recomputed_tokens_total": "counter",
    "twospeed_goodput_tokens_total": "counter", "twospeed_kv_cache_num_blocks": "gauge",
    "twospeed_kv_cache_block_bytes": "gauge", "twospeed_price_per_million_tokens": "gauge",
    "twospeed_step_time_seconds": "histogram", "twospeed_step_time_prediction_error": "histogram",
    "twospeed_step_prefill_budget_tokens": "histogram", "twospeed_step_target_seconds": "gauge",
    "twospeed_kv_cache_block_size_tokens": "gauge", "twospeed_kv_cache_bytes_per_token": "gauge",
    "twospeed_model_weight_bytes": "gauge", "twospeed_model_formats": "gauge",
    "twospeed_spec_draft_tokens_total": "counter", "twospeed_spec_accepted_tokens_total": "counter",
    "twospeed_spec_verify_steps_total": "counter", "twospeed_spec_accepted_tokens_per_position_total": "counter",
    "twospeed_spec_fallbacks_total": "counter"}


def test_metric_names_types_and_labels(server):
    text = httpx.get(f"{server.base}/metrics").text
    assert dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)) == METRIC_NAMES
    samples = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    suffixes = ("_bucket", "_count", "_sum")
    assert all(s in METRIC_NAMES or s.endswith(suffixes) and s.rsplit("_", 1)[0] in METRIC_NAMES for s in samples)
    m = parse_metrics(text)
    assert all(dict(ls).get("model") == "demo" for _, ls in m)
    assert {dict(ls)["kind"] for n, ls in m if n == "twospeed_step_tokens_count"} <= {"prefill", "decode"}
    assert {dict(ls)["kind"] for n, ls in m if n == "twospeed_step_time_seconds_count"} == {"prefill", "decode",
                                                                                         "mixed"}
    assert {dict(ls)["bound"] for n, ls in m if n == "twospeed_step_prefill_budget_tokens_count"} == {"time",
                                                                                                   "tokens"}
    assert all("lane" in dict(ls) for n, ls in m if n.startswith("twospeed_time_to_first_token"))


def test_metrics_match_the_responses(server):
    before = wait_idle(server.base)
    bills, served, gaps = [], 0, 0
    for i in range(4):
        for lane in ("default", "strict"):
            r = httpx.post(f"{server.url}/completions", timeout=30, json={
                "model": "demo", "prompt": "latency throughput prefill decode " * (i + 1), "max_tokens": 3 + i,
                "temperature": 0, "lane": lane})
            assert r.status_code == 200
            bills.append(r.json()["twospeed"]["bill"])
            served += 1
            gaps += r.json()["usage"]["completion_tokens"] - 1
    after = wait_idle(server.base)

    def delta(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    for name in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "e2e_request_latency_seconds"):
        assert delta(f"twospeed_{name}_count") == served, name
        assert delta(f"twospeed_{name}_bucket", le="+Inf") == served, name
    assert delta("twospeed_inter_token_latency_seconds_count") == gaps
    cached, prefilled = (delta("twospeed_prompt_tokens_total", kind=k) for k in ("cached", "prefilled"))
    assert cached + prefilled == sum(b["prompt_tokens"] for b in bills)
    assert cached == sum(b["cached_tokens"] for b in bills) and cached > 0  # lanes share the prompts' prefixes
    assert delta("twospeed_prefix_cache_queries_total") == sum(b["prompt_tokens"] for b in bills)
    assert delta("twospeed_prefix_cache_hits_total") == cached
    assert delta("twospeed_generation_tokens_total") == sum(b["output_tokens"] for b in bills)
    assert delta("twospeed_slo_requests_total", lane="strict", result="missed") == 4
    assert delta("twospeed_slo_requests_total", lane="default", result="met") == 4
    # goodput: the output of sequences that met their SLO (bills alternate default, strict)
    assert delta("twospeed_goodput_tokens_total", lane="default") == sum(b["output_tokens"] for b in bills[0::2])
    assert delta("twospeed_goodput_tokens_total", lane="strict") == 0
    assert delta("twospeed_forced_tokens_total") == delta("twospeed_recomputed_tokens_total") == 0
    assert delta("twospeed_step_tokens_count", kind="decode") > 0
    assert delta("twospeed_step_tokens_count", kind="prefill") > 0
    # every step with work is timed once, under the kind its tokens say, and its prediction judged once
    steps = {k: delta("twospeed_step_time_seconds_count", kind=k) for k in ("decode", "prefill", "mixed")}
    assert steps["decode"] + steps["mixed"] == delta("twospeed_step_tokens_count", kind="decode")
    assert steps["prefill"] + steps["mixed"] == delta("twospeed_step_tokens_count", kind="prefill")
    assert delta("twospeed_step_time_prediction_error_count") == sum(steps.values())
    assert delta("twospeed_step_time_seconds_sum") > 0
    assert metric_sum(after, "twospeed_kv_cache_cached_blocks") > 0
    assert all(dict(ls).get("model") == "demo" for n, ls in after if n.startswith("twospeed_"))


# -- disconnects return KV blocks ----------------------------------------------------------------
def test_disconnected_clients_are_aborted_and_free_their_blocks(server):
    before = wait_idle(server.base)
    body = {"model": "demo", "prompt": "a long answer please", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0}

    async def stream_and_leave(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", f"{server.url}/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # got a first chunk: hang up

    async def posts_then_leave(client: httpx.AsyncClient, n: int) -> int:
        """n non-streaming requests, dropped once the server runs them all; returns how many had already
        finished by then (none, unless the machine can decode 200 tokens faster than a /metrics poll)."""
        posts = [asyncio.create_task(client.post(f"{server.url}/completions", json=body)) for _ in range(n)]
        deadline = time.monotonic() + 30
        while not all(p.done() for p in posts):
            m = parse_metrics((await client.get(f"{server.base}/metrics")).text)
            if metric_sum(m, "twospeed_num_requests_running") + sum(p.done() for p in posts) >= n:
                break
            assert time.monotonic() < deadline, "the requests never ran"
            await asyncio.sleep(0.02)
        finished = [p for p in posts if p.done()]
        for p in posts:
            p.cancel()  # closes the connection: the server sees the client go
        await asyncio.gather(*posts, return_exceptions=True)
        assert all(p.result().status_code == 200 for p in finished)
        return len(finished)

    async def main() -> int:
        async with httpx.AsyncClient(timeout=60) as client:
            finished = await posts_then_leave(client, 4)
            await asyncio.gather(*[stream_and_leave(client) for _ in range(12)])
            return finished

    finished = asyncio.run(main())
    after = wait_idle(server.base, timeout=20)
    generated = (metric_sum(after, "twospeed_generation_tokens_total")
                 - metric_sum(before, "twospeed_generation_tokens_total"))
    assert generated - 200 * finished < (16 - finished) * 200 / 2, "aborted requests kept generating"
    # Histograms count only what was served: the aborted requests add nothing.
    assert (metric_sum(after, "twospeed_e2e_request_latency_seconds_count")
            - metric_sum(before, "twospeed_e2e_request_latency_seconds_count")) == finished


# -- schemathesis over the server's own OpenAPI document ----------------------------------------------
def shorten(body, positive: bool) -> None:
    """Keep generated requests cheap (this checks validation, not the model): few tokens, few choices."""
    if not isinstance(body, dict):
        return
    if positive and "model" in body:
        body["model"] = "demo"
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is None or isinstance(body[key], int) and body[key] > 4:
            body[key] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2


def fuzz(server, operation, mode, failures: list, max_examples: int = 30) -> None:
    """Send schemathesis-generated requests for one operation; record transport failures and 5xx answers."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        shorten(case.body, mode == GenerationMode.POSITIVE)
        try:
            response = case.call(base_url=server.base, timeout=60)
        except Exception as e:  # the transport failed: the server hung up or timed out
            failures.append((operation.label, case.body, type(e).__name__, str(e)[:300]))
            return
        if response.status_code >= 500:
            failures.append((operation.label, case.body, response.status_code, response.text[:300]))

    try:
        run()
    except Unsatisfiable:  # no way to make a negative case for an operation without inputs
        assert mode == GenerationMode.NEGATIVE


def test_schemathesis_finds_no_server_error(server):
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.base}/openapi.json")
    failures = []
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(server, operation, mode, failures)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= set(labels)
    assert not failures, failures[:3]
    assert httpx.get(f"{server.base}/health").status_code == 200
    wait_idle(server.base)


# -- soak --------------------------------------------------------------------------------------------
def test_soak_mixed_traffic(server):
    """Concurrent clients; valid, invalid and disconnecting requests; streaming and not. Every valid request
    is answered, nothing gets a 5xx, and no KV block is left in use."""
    rng = random.Random(0)
    words = "latency throughput prefill decode token cache block schedule request stream batch".split()
    results = {"ok": 0, "bad": 0, "left": 0}
    problems = []

    def make(i: int) -> tuple[str, str, dict]:
        kind = rng.choices(["completion", "chat", "invalid", "leave"], weights=[5, 4, 2, 2])[0]
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))
        common = {"model": "demo", "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.7]),
                  "stream": rng.random() < 0.5, "lane": rng.choice(["default", "drafting", "strict"])}
        if kind == "completion":
            return kind, "completions", {**common, "prompt": text}
        if kind == "chat":
            return kind, "chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        if kind == "leave":
            return kind, "completions", {**common, "prompt": text, "max_tokens": 150, "ignore_eos": True,
                                         "stream": True}
        bad = rng.choice([{"prompt": text, "max_tokens": 0}, {"prompt": text, "top_p": 7}, {"messages": []},
                          {"prompt": [10**9]}, {"prompt": text, "temperature": -1}, {"prompt": text * 40}])
        return kind, rng.choice(["completions", "chat/completions"]) if "messages" in bad else "completions", {
            **{k: v for k, v in common.items() if k != "stream"}, **bad}

    jobs = [make(i) for i in range(300)]

    async def run(client: httpx.AsyncClient, kind: str, path: str, body: dict) -> None:
        url = f"{server.url}/{path}"
        if kind == "leave":
            async with client.stream("POST", url, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            results["left"] += 1
            return
        if body.get("stream"):
            async with client.stream("POST", url, json=body) as r:
                status = r.status_code
                events = sse_events([line async for line in r.aiter_lines()]) if status == 200 else None
                if status == 200 and (events[-1] != "[DONE]" or not any(
                        c["choices"] and c["choices"][0]["finish_reason"] for c in events[:-1])):
                    problems.append((kind, body, "incomplete stream"))
        else:
            r = await client.post(url, json=body)
            status = r.status_code
            if status == 200 and not all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]):
                problems.append((kind, body, r.text[:200]))
        expected = 400 if kind == "invalid" else 200
        if status != expected:
            problems.append((kind, body, status))
        results["ok" if status == 200 else "bad"] += 1

    async def main():
        sem = asyncio.Semaphore(12)
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            async def guarded(job):
                async with sem:
                    await run(client, *job)
            await asyncio.wait_for(asyncio.gather(*[guarded(j) for j in jobs]), timeout=180)

    asyncio.run(main())
    assert not problems, problems[:5]
    assert sum(results.values()) == len(jobs)
    wait_idle(server.base, timeout=30)
    assert httpx.get(f"{server.base}/health").status_code == 200
