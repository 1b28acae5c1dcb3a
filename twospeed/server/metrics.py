"""Prometheus metrics of the server: the split clock per lane, the split bill, engine load.

The only module that imports prometheus_client. It reads plain engine objects (StepStats,
Clock, Bill) and never reaches into the engine. Names, units and definitions are listed in
README.md ("Metrics"). Each server owns its registry, so several apps can live in one process.

Per-request histograms get one observation per finished sequence (a request with n=3 is
three sequences), for sequences that finished by stop or length; aborted sequences (a
client that went away) count only in the token and preemption counters, since the work
was done. inter_token_latency gets one observation per gap between consecutive tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from twospeed.engine.engine import StepStats
from twospeed.engine.request import Bill, Clock
from twospeed.server.slo import Verdict

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The exposition holds exactly the documented names: no `_created` series beside each counter and histogram.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model = model_name
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r, lm = self.registry, ("lane", "model")

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS, labels=lm) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.ttft = hist("twospeed_time_to_first_token_seconds", "first_token - arrival, per sequence")
        self.itl = hist("twospeed_inter_token_latency_seconds", "gap between consecutive output tokens",
                        _ITL_BUCKETS)
        self.queue = hist("twospeed_request_queue_time_seconds", "first_scheduled - arrival, per sequence")
        self.prefill = hist("twospeed_request_prefill_time_seconds",
                            "prefill_done - first_scheduled (includes waits between chunks), per sequence")
        self.decode = hist("twospeed_request_decode_time_seconds", "finished - first_token, per sequence")
        self.e2e = hist("twospeed_e2e_request_latency_seconds", "finished - arrival (ttlt), per sequence")
        self.step_tokens = hist("twospeed_step_tokens", "tokens computed in one engine step, by kind",
                                _STEP_TOKEN_BUCKETS, ("kind", "model"))
        self.prompt_tokens = Counter("twospeed_prompt_tokens", "prompt tokens billed, by kind (cached|prefilled)",
                                     ("lane", "model", "kind"), registry=r)
        self.generation_tokens = Counter("twospeed_generation_tokens", "output tokens emitted", lm, registry=r)
        self.prefix_queries = Counter("twospeed_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      lm, registry=r)
        self.prefix_hits = Counter("twospeed_prefix_cache_hits", "prompt tokens found in the prefix cache", lm,
                                   registry=r)
        self.preemptions = Counter("twospeed_num_preemptions", "preemptions of finished sequences", lm, registry=r)
        self.slo = Counter("twospeed_slo_requests", "finished sequences judged against their lane's SLO",
                           ("lane", "model", "result", "cause"), registry=r)
        self.running = Gauge("twospeed_num_requests_running", "sequences in the running batch", lm, registry=r)
        self.waiting = Gauge("twospeed_num_requests_waiting", "sequences waiting (new or preempted)", lm, registry=r)
        self.kv_usage = Gauge("twospeed_kv_cache_usage_ratio", "KV blocks in use / KV blocks in the pool",
                              ("model",), registry=r)
        self.kv_cached = Gauge("twospeed_kv_cache_cached_blocks",
                               "KV blocks holding a cached prefix (in use or free and reusable)", ("model",),
                               registry=r)
        self.step_failures = Counter("twospeed_engine_step_failures",
                                     "engine steps that raised, by scope: request (only the requests that caused it "
                                     "failed) or step (every sequence in flight failed)", ("model", "scope"),
                                     registry=r)
        for scope in ("request", "step"):
            self.step_failures.labels(self.model, scope)
        self._lanes: set[str] = set()
        self.set_load({}, {}, 0.0, 0)

    # -- engine thread ---------------------------------------------------------------------------
    def on_step(self, stats: StepStats) -> None:
        if stats.num_prefill_tokens:
            self.step_tokens.labels("prefill", self.model).observe(stats.num_prefill_tokens)
        if stats.num_decode_tokens:
            self.step_tokens.labels("decode", self.model).observe(stats.num_decode_tokens)

    def on_fault(self, scope: str) -> None:
        self.step_failures.labels(self.model, scope).inc()

    def set_load(self, running: dict[str, int], waiting: dict[str, int], kv_usage: float, cached_blocks: int) -> None:
        """Per-lane running/waiting counts (lanes not named are 0) and the pool's state."""
        self._lanes |= running.keys() | waiting.keys()
        for lane in self._lanes:
            self.running.labels(lane, self.model).set(running.get(lane, 0))
            self.waiting.labels(lane, self.model).set(waiting.get(lane, 0))
        self.kv_usage.labels(self.model).set(kv_usage)
        self.kv_cached.labels(self.model).set(cached_blocks)

    def on_finished(self, lane: str, clock: Clock, bill: Bill, num_preemptions: int, aborted: bool,
                    verdict: Verdict | None) -> None:
        labels = (lane, self.model)
        if clock.first_scheduled is not None:  # billed only once admitted (the bill is set then)
            self.prompt_tokens.labels(lane, self.model, "cached").inc(bill.cached_tokens)
            self.prompt_tokens.labels(lane, self.model, "prefilled").inc(bill.prefilled_tokens)
            self.prefix_queries.labels(*labels).inc(bill.prompt_tokens)
            self.prefix_hits.labels(*labels).inc(bill.cached_tokens)
        self.generation_tokens.labels(*labels).inc(bill.output_tokens)
        if num_preemptions:
            self.preemptions.labels(*labels).inc(num_preemptions)
        if aborted or clock.ttlt is None:
            return
        for hist, value in ((self.ttft, clock.ttft), (self.queue, clock.queue_time), (self.prefill, clock.prefill_time),
                            (self.e2e, clock.ttlt)):
            if value is not None:
                hist.labels(*labels).observe(value)
        if clock.ttft is not None:
            self.decode.labels(*labels).observe(clock.ttlt - clock.ttft)
        itl = self.itl.labels(*labels)
        for gap in clock.itl:
            itl.observe(gap)
        if verdict is not None:
            self.slo.labels(lane, self.model, "met" if verdict.met else "missed", verdict.cause or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
