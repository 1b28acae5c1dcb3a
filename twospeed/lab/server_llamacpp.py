"""llama.cpp's llama-server: /v1/models says `owned_by: llamacpp` with a `meta` object, /props states the slot's
context (`default_generation_settings.n_ctx`), and every response's last event carries `timings`: prompt tokens
reused from the slot's cache (cache_n), prompt tokens computed (prompt_n) in prompt_ms, tokens generated
(predicted_n) in predicted_ms. That is a per-request prefill and decode clock and a cached/computed bill; the
server states no queue time (a request waits for a free slot before prompt_ms starts). It streams one token a
chunk and no usage before the last event (the recordings: 12 chunks with text, predicted_n 12): re-tokenizing a
chunk's text counts some pieces as two tokens, and gives those a 0 ms gap that never happened."""

from __future__ import annotations

from twospeed.lab.server_kind import RequestClock, ServerKind, _positive


class LlamaCpp(ServerKind):
    name = "llama.cpp"
    label = "llama.cpp"
    extra_paths = ("/props",)
    event_keys = ("timings",)
    one_token_per_chunk = True

    def matches(self, models: dict) -> bool:
        first = self.first_model(models)
        return first.get("owned_by") == "llamacpp" or (isinstance(first.get("meta"), dict) and "n_ctx_train" in first["meta"])

    def context_length(self, models: dict, extra: dict[str, dict]) -> tuple[int, str] | None:
        """The slot's context: /props, else /v1/models meta.n_ctx (n_ctx_train is the model's, not the server's)."""
        props = extra.get("/props") or {}
        n = (props.get("default_generation_settings") or {}).get("n_ctx")
        if _positive(n):
            return int(n), "llama.cpp's /props n_ctx"
        n = (self.first_model(models).get("meta") or {}).get("n_ctx")
        return (int(n), "llama.cpp's /v1/models meta.n_ctx") if _positive(n) else None

    def request_clock(self, resp) -> RequestClock | None:
        t = resp.peer.get("timings")
        if not t:
            return None
        return RequestClock("llama.cpp timings", prefill_ms=t.get("prompt_ms"), decode_ms=t.get("predicted_ms"),
                            cached_tokens=t.get("cache_n"), computed_tokens=t.get("prompt_n"),
                            output_tokens=t.get("predicted_n"))


LLAMA_CPP = LlamaCpp()
