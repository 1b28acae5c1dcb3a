"""Record what vLLM and llama-server send, for the lab's tests to replay (tests/fixtures/peers/<engine>/).

    .venv/bin/python benchmarks/peers/record_fixtures.py [--engines vllm,llama] [--out tests/fixtures/peers]

Each peer is started as serve.py starts it (the bf16 checkpoint, its defaults otherwise) and asked what the lab
asks of it: vLLM's /v1/models and /metrics before and after a few requests (a completion, a streamed completion
and a streamed chat with usage, then chats sharing a system block, so the prefix cache has hits), llama-server's
/props and /v1/models, a completion with `timings`, a streamed completion and a streamed chat, each asked twice
so the second reuses the slot's cache (cache_n); and from both, the refusal of a prompt longer than the context.
Bodies are stored as received (a stream as its raw server-sent events), local paths replaced by stand-ins;
manifest.json says what was sent, how many requests the engine finished between the two /metrics scrapes, and
the versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve import SETTINGS, WORK, serve  # noqa: E402

ROOT = HERE.parent.parent
SYSTEM = ("You are the order desk. Answer in one short sentence, citing the order id. Orders ship from the north "
          "warehouse unless the customer asks otherwise; refunds need a reason code.")
QUESTIONS = ("Where is order 4417?", "Can order 5120 be refunded?", "Why was order 3008 delayed?",
             "Ship order 7781 to the south depot.", "Cancel order 9902.")
PROMPT = "The order 4417 was delayed at the warehouse because"
TOO_LONG = " ".join(["warehouse"] * (SETTINGS.max_model_len + 200))  # over the context in any tokenizer


def _sse(client: httpx.Client, url: str, body: dict) -> str:
    """A streamed response as its raw text (server-sent events)."""
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        return r.read().decode()


def _refusal(client: httpx.Client, url: str, body: dict) -> dict:
    r = client.post(url, json=body)
    try:
        payload = r.json()
    except ValueError:
        payload = r.text
    return {"status": r.status_code, "body": payload}


def record_vllm(out: Path) -> dict:
    usage = {"include_usage": True, "continuous_usage_stats": True}
    with serve("vllm", "bf16") as s, httpx.Client(timeout=300) as c:
        base, model = s.url, s.model
        (out / "models.json").write_text(json.dumps(c.get(base + "/v1/models").json(), indent=1))
        c.post(base + "/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 4})  # first use
        time.sleep(1.0)
        (out / "metrics_before.txt").write_text(c.get(base + "/metrics").text)
        completion = c.post(base + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                             "temperature": 0}).json()
        (out / "completion.json").write_text(json.dumps(completion, indent=1))
        (out / "completion_stream.sse").write_text(_sse(c, base + "/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": usage}))
        chat = {"model": model, "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": usage}
        (out / "chat_stream.sse").write_text(_sse(c, base + "/v1/chat/completions", {
            **chat, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]}))
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # at once: they share the system block and may queue
            list(pool.map(lambda q: _sse(c, base + "/v1/chat/completions", {
                **chat, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}),
                QUESTIONS))
        (out / "context_error.json").write_text(json.dumps(_refusal(c, base + "/v1/completions", {
            "model": model, "prompt": TOO_LONG, "max_tokens": 16}), indent=1))
        time.sleep(2.0)  # the last request's histograms are recorded just after its last chunk
        (out / "metrics_after.txt").write_text(c.get(base + "/metrics").text)
    return {"engine": "vllm", "model": model, "finished_between_scrapes": 3 + len(QUESTIONS),
            "requests": ["completion (12 tokens)", "streamed completion", "streamed chat (recorded)",
                         f"{len(QUESTIONS)} streamed chats at once, same system block", "a too-long prompt (refused)"]}


def record_llama(out: Path) -> dict:
    with serve("llama", "bf16") as s, httpx.Client(timeout=300) as c:
        base, model = s.url, s.model
        (out / "props.json").write_text(json.dumps(c.get(base + "/props").json(), indent=1))
        (out / "models.json").write_text(json.dumps(c.get(base + "/v1/models").json(), indent=1))
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        c.post(base + "/v1/completions", json=body)  # the slot now holds the prompt: the next one reuses it
        (out / "completion.json").write_text(json.dumps(c.post(base + "/v1/completions", json=body).json(), indent=1))
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        (out / "completion_stream.sse").write_text(_sse(c, base + "/v1/completions", stream))
        chat = {"model": model, "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]}
        _sse(c, base + "/v1/chat/completions", chat)
        (out / "chat_stream.sse").write_text(_sse(c, base + "/v1/chat/completions", chat))
        (out / "context_error.json").write_text(json.dumps(_refusal(c, base + "/v1/completions", {
            "model": model, "prompt": TOO_LONG, "max_tokens": 16}), indent=1))
    return {"engine": "llama.cpp", "model": model,
            "requests": ["completion (12 tokens), the second of two identical ones", "streamed completion (the same "
                         "prompt again)", "streamed chat, the second of two identical ones", "a too-long prompt"]}


def scrub(out: Path) -> None:
    """Local paths out of the recorded bodies (a model's folder, the checkout): the fixtures name no machine."""
    for f in out.iterdir():
        text = f.read_text()
        for local, stand_in in ((str(ROOT), "CHECKOUT"), (str(Path.home()), "HOME")):
            text = text.replace(local, stand_in)
        f.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="vllm,llama")
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/peers"))
    args = ap.parse_args()
    versions = (WORK / "versions.txt").read_text() if (WORK / "versions.txt").is_file() else ""
    for engine in args.engines.split(","):
        out = Path(args.out) / engine
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        manifest = {"vllm": record_vllm, "llama": record_llama}[engine](out)
        manifest |= {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "max_model_len_setting": SETTINGS.max_model_len, "recorded_by": "benchmarks/peers/record_fixtures.py",
                     "versions": [line for line in versions.splitlines() if line and not line.startswith("#")]}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        scrub(out)
        print(f"{engine}: recorded in {time.monotonic() - t0:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
