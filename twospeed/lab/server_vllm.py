"""vLLM: /v1/models says `owned_by: vllm` and states max_model_len; its clock is on /metrics, as Prometheus
histograms over every request it finished: queue (arrival -> scheduled), prefill (scheduled -> first token),
decode (first -> last token), TTFT and end-to-end latency, plus prefix-cache queries and hits in tokens. The lab
scrapes them before and after the run and differences them: an aggregate over the run's requests (a lane's own
only when the run has that one lane), with percentiles from the buckets."""

from __future__ import annotations

from twospeed.lab import scrape
from twospeed.lab.server_kind import RunClock, ServerKind

PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds",
          "e2e": "vllm:e2e_request_latency_seconds"}
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PROMPT, GENERATION = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"


class Vllm(ServerKind):
    name = "vllm"
    label = "vLLM"
    metric_buckets = tuple(PHASES.values())

    def matches(self, models: dict) -> bool:
        return self.first_model(models).get("owned_by") == "vllm"

    def finished(self, before: dict | None, after: dict | None) -> float | None:
        d = scrape.delta(before, after)
        return None if not d or f"{PHASES['e2e']}_count" not in d else d[f"{PHASES['e2e']}_count"]

    def run_clock(self, before: dict | None, after: dict | None) -> RunClock | None:
        d = scrape.delta(before, after)
        if not d:
            return None
        phases = {name: h for name, family in PHASES.items() if (h := scrape.histogram(d, family)) is not None}
        if not phases:
            return None
        return RunClock("vLLM /metrics", phases["e2e"].count if "e2e" in phases else max(h.count for h in phases.values()),
                        phases, d.get(QUERIES), d.get(HITS), d.get(PROMPT), d.get(GENERATION))


VLLM = Vllm()
