"""Whose figure is whose: which of a run's numbers the client measured and which the server reported.

TTFT, ITL, TPOT and TTLT are always the client's (the stream as it arrived). Queue, prefill and decode are the
server's where it reports them: per request (twospeed's clock, llama.cpp's timings) or over the run (vLLM's
/metrics histograms, a lane's own only when the run has one lane); else not measured, and TTFT counts as
prefill. Token counts are the server's bill, its usage, or the client's count. report.py prints this beside the
numbers, so a reader never takes the client's TTFT for the server's.
"""

from __future__ import annotations

TOKEN_SOURCES = {"twospeed": "server: twospeed's per-chunk token counts", "usage": "server: usage per chunk",
                 "tokenizer": "client: --tokenizer on the streamed text", "chunks": "client: one token per chunk"}


def clock_sources(records: list[dict], run_clock: dict | None, lanes: int, server: str) -> dict[str, str]:
    """Figure -> its source, over the run's records (results.record) and its /metrics clock (RunClock.as_dict)."""
    ok = [r for r in records if r["error"] is None]
    out = {m: "client: the stream as received" for m in ("ttft", "itl", "tpot", "ttlt")}
    per_request = {r.get("clock_source") for r in ok if r.get("clock_source")}
    scope = "this run's only lane" if lanes == 1 else f"the run's {lanes} lanes together (not per lane)"
    aggregate = f"server: {run_clock['source']} over {scope}" if run_clock else None

    def pick(field: str, per_request_text: str) -> str | None:
        if ok and all(r.get(field) is not None for r in ok):
            return per_request_text
        if any(r.get(field) is not None for r in ok):
            return per_request_text + " (some requests)"
        return None

    sources = ", ".join(sorted(per_request)) or server
    out["queue"] = (pick("server_queue_s", f"server: {sources}, per request")
                    or ("derived: client TTFT less the server's prefill, per request"
                        if pick("server_prefill_s", "x") else None)
                    or aggregate or "not measured (TTFT counts as prefill)")
    out["prefill"] = (pick("server_prefill_s", f"server: {sources}, per request") or aggregate
                      or "client: TTFT (queue not separable)")
    out["decode"] = (pick("server_decode_s", f"server: {sources}, per request") or aggregate
                     or "client: the stream after its first token")
    if any(r.get("clock_source") == "twospeed" for r in ok):
        cached = "server: twospeed's bill, per request"
    elif any(r.get("clock_source") == "llama.cpp timings" for r in ok):
        cached = "server: llama.cpp timings cache_n, per request"
    elif any(r.get("cached_tokens") for r in ok):
        cached = "server: usage.prompt_tokens_details.cached_tokens, per request"
    else:
        cached = "not reported (0)"
    if run_clock and run_clock.get("prefix_cache_queries") is not None:
        cached += f"; prefix-cache hits: {aggregate}"
    out["cached_tokens"] = cached
    tokens = {r.get("token_source") for r in ok if r.get("token_source")}
    out["output_tokens"] = "; ".join(TOKEN_SOURCES.get(t, t) for t in sorted(tokens)) or "none"
    return out
