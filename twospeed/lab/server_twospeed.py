"""twospeed's own format: /v1/models states max_model_len and a `twospeed` object (weight and KV formats,
block size, KV bytes per token); every response's last chunk carries the request's `twospeed` object with its
clock (queue, route, prefill, TTFT, TTLT, decode and interfered steps) and bill, which the client keeps whole
(client.py: Response.server) because its token counts and emit times also drive the token timing."""

from __future__ import annotations

from twospeed.lab.server_kind import RequestClock, ServerKind


class Twospeed(ServerKind):
    name = "twospeed"
    label = "twospeed"

    def matches(self, models: dict) -> bool:
        first = self.first_model(models)
        return isinstance(first.get("twospeed"), dict) or first.get("owned_by") == "twospeed"

    def memory(self, models: dict) -> dict | None:
        memory = self.first_model(models).get("twospeed")
        return memory if isinstance(memory, dict) else None

    def request_clock(self, resp) -> RequestClock | None:
        clock = (resp.server or {}).get("clock")
        if not clock:
            return None
        bill = (resp.server or {}).get("bill") or {}
        return RequestClock("twospeed", clock.get("queue_ms"), clock.get("route_ms"), clock.get("prefill_ms"),
                            None, clock.get("ttft_ms"), clock.get("ttlt_ms"), clock.get("decode_steps"),
                            clock.get("interfered_steps"), bill.get("cached_tokens"), bill.get("prefilled_tokens"),
                            bill.get("output_tokens"))


TWOSPEED = Twospeed()
