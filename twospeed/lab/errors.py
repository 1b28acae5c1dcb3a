"""Error classes: what kind of failure a request met, so a run says "14 context_length" instead of 14 raw bodies.

A class is read from the HTTP status and the message the client recorded (client.py writes `HTTP <status>: <body>`
for a refusal, `<ExceptionName>: <text>` for a transport failure, the server's own text for an error event in the
stream). Context refusals are told apart from other 400s by the wording each server uses: vLLM's "maximum context
length", llama.cpp's `exceed_context_size_error`, twospeed's `max_model_len`, OpenAI's `context_length_exceeded`.
"""

from __future__ import annotations

import re

CLASSES = ("context_length", "job_context", "bad_request", "auth", "not_found", "rate_limited", "overloaded",
           "server_error", "timeout", "connection", "stream_error", "other")

# what each class tells the user to do (the diagnosis prints it once per class)
HINTS = {
    "context_length": "prompt + max_tokens over the server's context: the lab fits prompts to the context the server "
                      "states, so give --max-model-len when it states none, or lower --scale / --max-prompt-tokens",
    "job_context": "a job's history outgrew the context the lab fitted it to (its turns and dumps drew long): "
                   "summarize the dumps (--summarize-dumps) or lower --scale",
    "bad_request": "the server refused the request's body (an unsupported field such as response_format?)",
    "auth": "the server wants an --api-key",
    "not_found": "wrong --model name or URL",
    "rate_limited": "the server rate-limits: lower --rate",
    "overloaded": "the server shed load (503): its queue is full",
    "server_error": "the server failed (5xx): see its log",
    "timeout": "no answer within --timeout",
    "connection": "the connection failed or broke mid-stream",
    "stream_error": "the server sent an error event mid-stream",
    "other": "see requests.csv",
}

_CONTEXT = re.compile(r"context length|context size|context_length_exceeded|exceed_context_size|max_model_len|"
                      r"maximum context|too many tokens|input tokens? exceed", re.I)
_STATUS = re.compile(r"^HTTP (\d{3})\b")
_TIMEOUTS = ("ReadTimeout", "ConnectTimeout", "WriteTimeout", "PoolTimeout", "TimeoutException")
_CONNECTION = ("ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "NetworkError", "OSError",
               "ConnectionError", "LocalProtocolError", "CloseError")
JOB_CONTEXT_PREFIX = "the job's history reached"  # job_script.ContextFull's wording


def classify(error: str | None, status: int = 0) -> str | None:
    """The class of a recorded error (None when there is none)."""
    if error is None:
        return None
    m = _STATUS.match(error)
    code = int(m.group(1)) if m else (status if status and status != 200 else 0)
    head = error.split(":", 1)[0].strip()
    if JOB_CONTEXT_PREFIX in error:
        return "job_context"
    if head in _TIMEOUTS:
        return "timeout"
    if head in _CONNECTION:
        return "connection"
    if code:
        if code in (400, 413, 422) and _CONTEXT.search(error):
            return "context_length"
        if code in (401, 403):
            return "auth"
        if code == 404:
            return "not_found"
        if code == 429:
            return "rate_limited"
        if code == 503:
            return "overloaded"
        if code >= 500:
            return "server_error"
        if code >= 400:
            return "bad_request"
    if _CONTEXT.search(error):
        return "context_length"
    return "stream_error" if status == 200 else "other"


def count(records: list[dict]) -> dict[str, int]:
    """Errors per class over some records, most frequent first (classes in CLASSES order on ties)."""
    out: dict[str, int] = {}
    for r in records:
        c = r.get("error_class") or classify(r.get("error"), r.get("status") or 0)
        if c is not None:
            out[c] = out.get(c, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], CLASSES.index(kv[0]) if kv[0] in CLASSES else 99)))


def text(by_class: dict[str, int]) -> str:
    """'context_length 14, timeout 2'."""
    return ", ".join(f"{k} {v}" for k, v in by_class.items())
