"""twospeed's own format: /v1/models states max_model_len and a `twospeed` object (weight and KV formats,
block size, KV bytes per token); every response's last chunk carries the request's `twospeed` object with its
clock (queue, route, prefill, TTFT, TTLT, decode and interfered steps) and bill, which the client keeps whole
(client.py: Response.server) because its token counts and emit times also drive the token timing; it is read
through schema/twospeed_object.py, which the server writes it with."""

from __future__ import annotations

from twospeed.lab.server_kind import RequestClock, ServerKind
from twospeed.schema.twospeed_object import read_twospeed


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
        report = read_twospeed(resp.server)
        if report is None or report.clock is None:
            return None
        c, b = report.clock, report.bill
        return RequestClock("twospeed", c.queue_ms, c.route_ms, c.prefill_ms, None, c.ttft_ms, c.ttlt_ms,
                            c.decode_steps, c.interfered_steps, b.cached_tokens if b else None,
                            b.prefilled_tokens if b else None, b.output_tokens if b else None)


TWOSPEED = Twospeed()
