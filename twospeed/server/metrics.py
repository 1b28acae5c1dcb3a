"""Prometheus metrics of the server: the split clock per lane, the split bill, engine load.

With server/exposition.py and cluster/metrics.py, the only modules that import prometheus_client. It reads
plain engine objects (StepStats, Clock, Bill) and never reaches into the engine. Names, units and definitions
are listed in README.md ("Metrics"). Each server owns its registry, so several apps can live in one process.

Per-request histograms get one observation per finished sequence (a request with n=3 is
three sequences), for sequences that finished by stop or length; aborted sequences (a
client that went away) count only in the token and preemption counters, since the work
was done. inter_token_latency gets one observation per gap between consecutive tokens.
"""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from twospeed.engine.engine_stats import EngineMemory, StepStats
from twospeed.engine.request import SPEC_OFF_CAUSES, Clock, SpecTrace
from twospeed.serving.events import EngineEvent, FaultEvent, FinishEvent, LoadEvent, StepEvent
from twospeed.server.exposition import Exposition
from twospeed.schema.slo import CAUSES, Verdict

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The exposition holds exactly the documented names: no `_created` series beside each counter and histogram.
disable_created_metrics()


def geometric_buckets(lo: float, hi: float, per_decade: int) -> tuple[float, ...]:
    """Bucket bounds from lo to hi (inclusive), `per_decade` to a decade (each 10**(1/per_decade) times the last),
    rounded to 4 significant digits. histogram_quantile interpolates linearly inside a bucket, so its estimate of
    a quantile is off by at most one bucket's width: with 25 to a decade (x1.096), under 10%."""
    n = math.ceil(per_decade * math.log10(hi / lo) - 1e-9)
    return tuple(float(f"{lo * 10 ** (k / per_decade):.4g}") for k in range(n + 1))


# Fine where SLOs live (TTFT 2 ms - 30 s, ITL 2 ms - 1 s: histogram_quantile's p99 within 10% of the exact one;
# coarse outside. The old 1.0 -> 2.5 s and 2.5 -> 5 s steps made Prometheus's p99 twice the clients'; a 5 -> 10 ms
# step made it 9.8 ms against 6.0 for short prompts on a Zen 5 core, where TTFT was fine only from 10 ms.)
TTFT_BUCKETS = (0.001, *geometric_buckets(0.002, 30.0, 25), 60.0, 120.0, 300.0, 600.0, 1200.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, *geometric_buckets(0.002, 1.0, 25), 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS = (*geometric_buckets(0.001, 1000.0, 10), 2560.0)  # queue, prefill, decode, e2e: x1.26
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_TIME_BUCKETS = (*geometric_buckets(0.001, 10.0, 10), 30.0)  # one engine step: x1.26
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)  # |predicted - measured| / measured
PROMPT_KINDS = ("cached", "prefilled")
STEP_KINDS = ("prefill", "decode")
STEP_TIME_KINDS = ("decode", "prefill", "mixed")  # mixed: prompt chunks beside decodes, the steps streams wait on
BUDGET_BOUNDS = ("time", "tokens")
FAULT_SCOPES = ("request", "step")


class ServerMetrics:
    """The server's registry; `on_event` is its engine listener (serving/events.py)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, lanes: tuple[str, ...] = ()):
        self.model = model_name
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.exposition = Exposition(self.registry)  # generate_latest's text, series labels formatted once
        self._render: asyncio.Future | None = None  # the render under way, shared by the scrapes that wait on it
        r, lm = self.registry, ("lane", "model")

        def hist(name: str, doc: str, buckets=PHASE_BUCKETS, labels=lm) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.ttft = hist("twospeed_time_to_first_token_seconds", "first_token - arrival, per sequence", TTFT_BUCKETS)
        self.itl = hist("twospeed_inter_token_latency_seconds", "gap between consecutive output tokens", ITL_BUCKETS)
        self.queue = hist("twospeed_request_queue_time_seconds", "first_scheduled - arrival, per sequence")
        self.prefill = hist("twospeed_request_prefill_time_seconds",
                            "prefill_done - first_scheduled (includes waits between chunks), per sequence")
        self.decode = hist("twospeed_request_decode_time_seconds", "finished - first_token, per sequence")
        self.e2e = hist("twospeed_e2e_request_latency_seconds", "finished - arrival (ttlt), per sequence")
        self.step_tokens = hist("twospeed_step_tokens", "tokens computed in one engine step, by kind",
                                STEP_TOKEN_BUCKETS, ("kind", "model"))
        self.step_time = hist("twospeed_step_time_seconds",
                              "one engine step's measured time, by kind (decode, prefill, or mixed: both)",
                              STEP_TIME_BUCKETS, ("kind", "model"))
        self.step_error = hist("twospeed_step_time_prediction_error",
                               "|predicted - measured| / measured step time of the step cost model, per step",
                               ERROR_BUCKETS, ("model",))
        self.prefill_budget = hist("twospeed_step_prefill_budget_tokens",
                                   "prompt tokens a step beside decodes allowed, by what bound it (time or tokens)",
                                   STEP_TOKEN_BUCKETS, ("bound", "model"))
        self.step_target = Gauge("twospeed_step_target_seconds",
                                 "the step-time target of the last step that carried decodes (0: none)",
                                 ("model",), registry=r)
        self.prompt_tokens = Counter("twospeed_prompt_tokens", "prompt tokens billed, by kind (cached|prefilled)",
                                     ("lane", "model", "kind"), registry=r)
        self.generation_tokens = Counter("twospeed_generation_tokens", "output tokens emitted", lm, registry=r)
        self.lane_overflow = Counter("twospeed_lane_overflow", "requests run in the default lane because their "
                                     "lane was new past the bound on distinct lanes", ("model",), registry=r)
        self.lane_overflow.labels(model_name)
        self.forced_tokens = Counter("twospeed_forced_tokens",
                                     "output tokens a grammar forced (appended without a decode step)", lm, registry=r)
        self.recomputed_tokens = Counter("twospeed_recomputed_tokens",
                                         "tokens computed again after a preemption dropped their KV", lm, registry=r)
        self.goodput_tokens = Counter("twospeed_goodput_tokens",
                                      "output tokens of finished sequences that met their lane's SLO", lm, registry=r)
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
        self.kv_blocks = Gauge("twospeed_kv_cache_num_blocks", "KV blocks in the pool", ("model",), registry=r)
        self.kv_block_bytes = Gauge("twospeed_kv_cache_block_bytes", "bytes of K and V one KV block holds (all layers)",
                                    ("model",), registry=r)
        self.price = Gauge("twospeed_price_per_million_tokens", "the --price table: dollars per 1M tokens, by kind "
                           "(input: prefilled, cached_input, output)", ("kind", "model"), registry=r)
        self.spec_drafts = Counter("twospeed_spec_draft_tokens", "draft tokens verified (speculative decoding)", lm,
                                   registry=r)
        self.spec_accepted = Counter("twospeed_spec_accepted_tokens",
                                     "draft tokens kept as output tokens (each one beyond its step's own)", lm,
                                     registry=r)
        self.spec_steps = Counter("twospeed_spec_verify_steps", "decode steps that verified draft tokens", lm,
                                  registry=r)
        self.spec_position = Counter("twospeed_spec_accepted_tokens_per_position",
                                     "verify steps that kept the draft at this position (1 = the first draft)",
                                     ("lane", "model", "position"), registry=r)
        self.spec_fallbacks = Counter("twospeed_spec_fallbacks",
                                      "sequences that stopped (or never started) speculating, by cause: low_gain, "
                                      "lane_estimate (expected gain below 1), opted_out, lane_policy",
                                      ("lane", "model", "cause"), registry=r)
        self.spec_positions = 0  # draft positions counted (num_speculative_tokens; set_spec)
        self.step_failures = Counter("twospeed_engine_step_failures",
                                     "engine steps that raised, by scope: request (only the requests that caused it "
                                     "failed) or step (every sequence in flight failed)", ("model", "scope"),
                                     registry=r)
        for scope in FAULT_SCOPES:
            self.step_failures.labels(self.model, scope)
        for kind in STEP_KINDS:
            self.step_tokens.labels(kind, self.model)
        for kind in STEP_TIME_KINDS:
            self.step_time.labels(kind, self.model)
        for bound in BUDGET_BOUNDS:
            self.prefill_budget.labels(bound, self.model)
        self.step_error.labels(self.model)
        self.step_target.labels(self.model)
        self.kv_block_size = Gauge("twospeed_kv_cache_block_size_tokens", "tokens per KV block", ("model",),
                                   registry=r)
        self.kv_token_bytes = Gauge("twospeed_kv_cache_bytes_per_token",
                                    "bytes of K and V of one token, every layer, in the cache's format (scales included)",
                                    ("model",), registry=r)
        self.weight_bytes = Gauge("twospeed_model_weight_bytes", "bytes a decode step reads for the weights, in their "
                                  "format", ("model",), registry=r)
        self.formats = Gauge("twospeed_model_formats", "1, labelled with the weight format (quantization) and the KV "
                             "cache dtype", ("model", "quantization", "kv_cache_dtype"), registry=r)
        self._lanes: set[str] = set()
        for lane in lanes:
            self.add_lane(lane)
        self.set_load({}, {}, 0.0, 0)

    def set_pool(self, num_blocks: int, block_bytes: int, price_per_m: dict[str, float]) -> None:
        """Facts fixed at start: the KV pool's size and block bytes, the price table."""
        self.kv_blocks.labels(self.model).set(num_blocks)
        self.kv_block_bytes.labels(self.model).set(block_bytes)
        for kind, dollars in price_per_m.items():
            self.price.labels(kind, self.model).set(dollars)

    def set_spec(self, num_positions: int) -> None:
        """Speculation is on with up to num_positions drafts a step: its per-position series start at 0 too."""
        self.spec_positions = num_positions
        for lane in tuple(self._lanes):
            self._spec_series(lane)

    def _spec_series(self, lane: str) -> None:
        for position in range(1, self.spec_positions + 1):
            self.spec_position.labels(lane, self.model, str(position))
        for cause in SPEC_OFF_CAUSES:
            self.spec_fallbacks.labels(lane, self.model, cause)

    def add_lane(self, lane: str) -> None:
        """Every series of a lane at 0, so that rate() over it is 0 rather than nothing before its first request."""
        if lane in self._lanes:
            return
        self._lanes.add(lane)
        labels = (lane, self.model)
        for metric in (self.ttft, self.itl, self.queue, self.prefill, self.decode, self.e2e, self.generation_tokens,
                       self.forced_tokens, self.recomputed_tokens, self.goodput_tokens, self.prefix_queries,
                       self.prefix_hits, self.preemptions, self.running, self.waiting, self.spec_drafts,
                       self.spec_accepted, self.spec_steps):
            metric.labels(*labels)
        self._spec_series(lane)
        for kind in PROMPT_KINDS:
            self.prompt_tokens.labels(lane, self.model, kind)
        self.slo.labels(lane, self.model, "met", "none")
        for cause in CAUSES:
            self.slo.labels(lane, self.model, "missed", cause)

    # -- engine thread ---------------------------------------------------------------------------
    def on_event(self, event: EngineEvent) -> None:
        match event:
            case StepEvent(stats):
                self.on_step(stats)
            case LoadEvent(running, waiting, kv_usage, cached_blocks):
                self.set_load(running, waiting, kv_usage, cached_blocks)
            case FinishEvent(lane, request, aborted, verdict):
                self.on_finished(lane, event.counts(), request.clock, aborted, verdict)
                self.on_spec(lane, request.spec)
            case FaultEvent(scope):
                self.step_failures.labels(self.model, scope).inc()

    def on_step(self, stats: StepStats) -> None:
        prefill, decode = stats.num_prefill_tokens, stats.num_decode_tokens
        if prefill:
            self.step_tokens.labels("prefill", self.model).observe(prefill)
        if decode:
            self.step_tokens.labels("decode", self.model).observe(decode)
        if not prefill and not decode:
            return
        kind = "mixed" if prefill and decode else "prefill" if prefill else "decode"
        self.step_time.labels(kind, self.model).observe(stats.step_time)
        if stats.predicted_time is not None and stats.step_time > 0:
            self.step_error.labels(self.model).observe(abs(stats.predicted_time - stats.step_time) / stats.step_time)
        if decode:
            self.step_target.labels(self.model).set(stats.target_time or 0.0)
            if prefill or stats.time_bound:
                self.prefill_budget.labels("time" if stats.time_bound else "tokens", self.model).observe(
                    stats.prefill_budget)

    def set_load(self, running: dict[str, int], waiting: dict[str, int], kv_usage: float, cached_blocks: int) -> None:
        """Per-lane running/waiting counts (lanes not named are 0) and the pool's state."""
        for lane in running.keys() | waiting.keys():
            self.add_lane(lane)
        for lane in tuple(self._lanes):  # add_lane may run on the event loop meanwhile
            self.running.labels(lane, self.model).set(running.get(lane, 0))
            self.waiting.labels(lane, self.model).set(waiting.get(lane, 0))
        self.kv_usage.labels(self.model).set(kv_usage)
        self.kv_cached.labels(self.model).set(cached_blocks)

    def set_memory(self, memory: EngineMemory) -> None:
        """The weights' and the KV cache's formats and sizes, once the engine is built (the pool: set_pool)."""
        self.kv_block_size.labels(self.model).set(memory.block_size)
        self.kv_token_bytes.labels(self.model).set(memory.kv_bytes_per_token)
        self.weight_bytes.labels(self.model).set(memory.weight_bytes)
        self.formats.labels(self.model, memory.quantization or "none", memory.kv_cache_dtype).set(1)

    def on_finished(self, lane: str, counts: dict[str, int], clock: Clock, aborted: bool,
                    verdict: Verdict | None) -> None:
        """counts: FinishEvent.counts(). Aborted sequences count in the token counters only (the work was done)."""
        self.add_lane(lane)
        labels = (lane, self.model)
        for kind in PROMPT_KINDS:
            self.prompt_tokens.labels(lane, self.model, kind).inc(counts[f"{kind}_tokens"])
        for counter, key in ((self.generation_tokens, "output_tokens"), (self.forced_tokens, "forced_tokens"),
                             (self.recomputed_tokens, "recomputed_tokens"), (self.goodput_tokens, "goodput_tokens"),
                             (self.prefix_queries, "prefix_queries"), (self.prefix_hits, "prefix_hits"),
                             (self.preemptions, "preemptions")):
            if counts[key]:
                counter.labels(*labels).inc(counts[key])
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

    def on_spec(self, lane: str, trace: SpecTrace) -> None:
        """A finished sequence's speculation: drafts, kept drafts, verify steps, kept by position, fallbacks."""
        labels = (lane, self.model)
        for counter, value in ((self.spec_drafts, trace.proposed), (self.spec_accepted, trace.accepted),
                               (self.spec_steps, trace.verify_steps)):
            if value:
                counter.labels(*labels).inc(value)
        for i, kept in enumerate(trace.accepted_per_position):
            if kept:
                self.spec_position.labels(lane, self.model, str(i + 1)).inc(kept)
        for e in trace.events:
            if e.cause is not None:
                self.spec_fallbacks.labels(lane, self.model, e.cause).inc()

    def render(self) -> bytes:
        return self.exposition.render()

    async def render_shared(self, run) -> bytes:
        """render() in a worker thread (`run`: ServerState.run), never on the event loop, and once for every
        scrape that arrives while it is under way: 20 concurrent scrapes cost one render, not 20 back to back
        on the loop that writes every stream (one took the loop ~20 ms; twenty stretched another client's
        stream gap from 33 to 294 ms)."""
        if self._render is None:
            self._render = asyncio.ensure_future(run(self.render))
            self._render.add_done_callback(lambda _: setattr(self, "_render", None))
        return await asyncio.shield(self._render)
