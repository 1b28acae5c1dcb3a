"""The split bill of a run: input tokens that paid a full prefill, cached prefix tokens, output tokens,
goodput tokens, money from a price table, and the KV memory that cached prefixes hold while they wait.

Token counts come from the server's own bill (twospeed's `twospeed.bill`) when it sends one, else from a peer's
per-request clock (llama.cpp's `timings`: cache_n cached, prompt_n computed), else from OpenAI's `usage`
(`prompt_tokens_details.cached_tokens`), else from the client's count.
"""

from __future__ import annotations

from twospeed.schema import formats
from twospeed.schema.price import Price
from twospeed.schema.twospeed_object import read_twospeed

FIELDS = ("prompt_tokens", "cached_tokens", "prefilled_tokens", "output_tokens", "goodput_tokens", "forced_tokens",
          "spec_proposed", "spec_accepted")


def request_bill(usage: dict | None, server: dict | None, client_prompt_tokens: int, client_output_tokens: int,
                 good: bool, clock=None) -> dict:
    """One request's bill (token counts) from the best source available: the server's `twospeed` object, then
    `clock` (a server_kind.RequestClock), then OpenAI's usage, then the client's own counts."""
    report = read_twospeed(server)
    sb = report.bill if report else None
    if sb:
        prompt, cached, out = sb.prompt_tokens, sb.cached_tokens, sb.output_tokens
    elif clock is not None and clock.cached_tokens is not None and clock.computed_tokens is not None:
        cached = clock.cached_tokens
        prompt = cached + clock.computed_tokens
        out = (usage or {}).get("completion_tokens", clock.output_tokens if clock.output_tokens is not None
                                else client_output_tokens)
    elif usage:
        prompt = usage.get("prompt_tokens", client_prompt_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out = usage.get("completion_tokens", client_output_tokens)
    else:
        prompt, cached, out = client_prompt_tokens, 0, client_output_tokens
    # forced: output tokens a grammar forced without a decode step of their own (twospeed's jump-forward);
    # they arrive with the token before them, at ITL 0. Speculation (twospeed): draft tokens verified, and those
    # kept as output (each beyond its step's own token)
    forced, proposed, accepted = (sb.forced_tokens, sb.spec_proposed, sb.spec_accepted) if sb else (0, 0, 0)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "prefilled_tokens": prompt - cached,
            "output_tokens": out, "goodput_tokens": out if good else 0, "forced_tokens": forced,
            "spec_proposed": proposed, "spec_accepted": accepted}


def money(bill: dict, price: Price) -> dict:
    """Dollars: prefilled input, cached input, output, and the total."""
    d = {"input_usd": bill["prefilled_tokens"] * price.input_per_m / 1e6,
         "cached_input_usd": bill["cached_tokens"] * price.cached_input_per_m / 1e6,
         "output_usd": bill["output_tokens"] * price.output_per_m / 1e6}
    d["total_usd"] = sum(d.values())
    return d


def total(bills: list[dict]) -> dict:
    return {k: sum(b[k] for b in bills) for k in FIELDS}


def kv_memory(cached_blocks: float | None, block_size: int, bytes_per_token: int | None) -> dict:
    """The KV memory held by cached prefix blocks at the end of the run (None where the server or the
    model config does not say)."""
    tokens = None if cached_blocks is None else int(cached_blocks) * block_size
    nbytes = None if tokens is None or bytes_per_token is None else tokens * bytes_per_token
    return {"cached_blocks": None if cached_blocks is None else int(cached_blocks), "block_size": block_size,
            "cached_tokens_held": tokens, "kv_bytes_per_token": bytes_per_token, "cached_kv_bytes": nbytes}


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2, kv_cache_dtype: str = "auto") -> int | None:
    """K and V for every layer and KV head, from a HF config.json (None if the fields are missing), counted as
    schema/formats.py counts every format."""
    try:
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return formats.kv_bytes_per_token(config["num_hidden_layers"], heads, head_dim, kv_cache_dtype, dtype_bytes)
    except (KeyError, TypeError, ZeroDivisionError):
        return None
