"""Which server the lab is talking to, and how that server reports on itself.

Every OpenAI-compatible server streams the same chunks, but each reports its own clock in its own format:
twospeed in a `twospeed` object per response, llama.cpp in a `timings` object per response, vLLM in Prometheus
histograms on /metrics. A `ServerKind` is one such format: how to recognise the server from /v1/models (and
the documents it adds, such as llama.cpp's /props), where it states its context length, which per-response
objects to keep from the stream, how to read one request's clock from them, and how to read the run's clock
from /metrics scraped before and after. `probe` asks the server once, before any traffic, and picks the
first kind that recognises it (GENERIC when none does).

Figures a kind returns are the server's own and say so (`source`); everything else in a run is the client's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import httpx


@dataclass(slots=True)
class RequestClock:
    """One request as its server timed and billed it (ms; None where the server does not say)."""

    source: str  # e.g. "twospeed" or "llama.cpp timings": who measured it
    queue_ms: float | None = None  # arrival -> scheduled
    route_ms: float | None = None  # behind a router: the hop to the replica (inside queue)
    prefill_ms: float | None = None  # prompt computed -> first token
    decode_ms: float | None = None  # first token -> last token
    ttft_ms: float | None = None  # arrival -> first token
    ttlt_ms: float | None = None  # arrival -> last token
    decode_steps: int | None = None
    interfered_steps: int | None = None  # decode steps that shared the batch with a prefill chunk
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    computed_tokens: int | None = None  # prompt tokens prefilled
    output_tokens: int | None = None


@dataclass(slots=True)
class HistogramStat:
    """One Prometheus histogram over a run: the differenced count and sum, and for p50/p90/p99 the upper bound of
    the differenced bucket each falls in (an upper bound, not an estimate: None past the largest bound)."""

    count: float
    sum_s: float
    p50_s: float | None = None
    p90_s: float | None = None
    p99_s: float | None = None

    @property
    def mean_s(self) -> float | None:
        return self.sum_s / self.count if self.count > 0 else None


@dataclass(slots=True)
class RunClock:
    """A run's server clock from /metrics: per-phase histograms over every request the server finished in the
    run, and its prefix-cache counters (tokens). Aggregate, never per request."""

    source: str  # e.g. "vLLM /metrics"
    requests: float  # requests the server finished between the two scrapes
    phases: dict[str, HistogramStat] = field(default_factory=dict)  # queue, prefill, decode, ttft, e2e
    prefix_cache_queries: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: float | None = None  # of those, found
    prompt_tokens: float | None = None
    generation_tokens: float | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q and self.prefix_cache_hits is not None else None

    def mean_ms(self, phase: str) -> float | None:
        h = self.phases.get(phase)
        return None if h is None or h.mean_s is None else h.mean_s * 1e3

    def as_dict(self) -> dict:
        d = asdict(self)
        for name, h in self.phases.items():
            d["phases"][name]["mean_s"] = h.mean_s
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d


@dataclass(slots=True)
class ServerInfo:
    """What the server says about itself before the run."""

    kind: "ServerKind"
    models: dict  # /v1/models as returned
    extra: dict[str, dict]  # the kind's further documents by path (llama.cpp's /props)
    context_length: int | None  # tokens, prompt and output together
    context_source: str  # where it was stated ("vLLM /v1/models max_model_len", "--max-model-len", "")

    @property
    def memory(self) -> dict | None:
        return self.kind.memory(self.models)


class ServerKind:
    """An OpenAI-compatible server that says nothing about itself beyond /v1/models (the base of every kind)."""

    name = "other"  # results.json run.server_kind
    label = "the server"  # for people
    extra_paths: tuple[str, ...] = ()  # documents to fetch (from the server root) once recognised
    event_keys: tuple[str, ...] = ()  # per-response objects the stream's events carry (kept in Response.peer)
    metric_buckets: tuple[str, ...] = ()  # histogram families whose buckets /metrics parsing must keep
    one_token_per_chunk = False  # each streamed chunk with text carries exactly one token (when usage says nothing)

    def matches(self, models: dict) -> bool:
        return True

    @staticmethod
    def first_model(models: dict) -> dict:
        data = models.get("data") if isinstance(models, dict) else None
        return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}

    def context_length(self, models: dict, extra: dict[str, dict]) -> tuple[int, str] | None:
        """(tokens, where stated): the common `max_model_len` field of /v1/models, if the server has it."""
        n = self.first_model(models).get("max_model_len")
        return (int(n), f"{self.label}'s /v1/models max_model_len") if _positive(n) else None

    def memory(self, models: dict) -> dict | None:
        return None

    def observe(self, event: dict, resp) -> None:
        """Keep this kind's per-response objects from one stream event (the last one seen wins)."""
        for key in self.event_keys:
            value = event.get(key)
            if isinstance(value, dict):
                resp.peer[key] = value

    def request_clock(self, resp) -> RequestClock | None:
        return None

    def run_clock(self, before: dict | None, after: dict | None) -> RunClock | None:
        return None

    def finished(self, before: dict | None, after: dict | None) -> float | None:
        """Requests /metrics counts as finished between the scrapes (None: it does not count them), so the lab
        can scrape again until the last request is in."""
        return None


def _positive(n) -> bool:
    return isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0


GENERIC = ServerKind()


def kinds() -> tuple[ServerKind, ...]:
    """The known kinds, most specific first (GENERIC last)."""
    from twospeed.lab.server_llamacpp import LLAMA_CPP
    from twospeed.lab.server_twospeed import TWOSPEED
    from twospeed.lab.server_vllm import VLLM

    return TWOSPEED, VLLM, LLAMA_CPP, GENERIC


def by_name(name: str) -> ServerKind:
    return next((k for k in kinds() if k.name == name), GENERIC)


def probe(url: str, client: httpx.Client, max_model_len: int | None = None) -> ServerInfo:
    """Ask the server at `url` (the API root, .../v1) what it is and how long a request may be. `max_model_len`
    (--max-model-len) stands in where the server states none, and lowers what it states, never raises it.
    Raises ConnectionError when the server cannot be reached or wants a key."""
    try:
        r = client.get(url + "/models")
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {url}: {e}") from None
    if r.status_code in (401, 403):
        raise ConnectionError(f"{url}: HTTP {r.status_code} (an --api-key is needed)")
    try:
        models = r.json() if r.status_code == 200 else {}
    except ValueError:
        models = {}
    models = models if isinstance(models, dict) else {}
    kind = next(k for k in kinds() if k.matches(models))
    root = url.removesuffix("/v1")
    extra = {}
    for path in kind.extra_paths:
        try:
            doc = client.get(root + path)
            extra[path] = doc.json() if doc.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            extra[path] = {}
    stated = kind.context_length(models, extra)
    if stated is None:
        length, source = (max_model_len, "--max-model-len") if max_model_len else (None, "")
    elif max_model_len and max_model_len < stated[0]:
        length, source = max_model_len, f"--max-model-len (below {stated[1]}, {stated[0]:,})"
    else:
        length, source = stated
    return ServerInfo(kind, models, extra, length, source)


class AnyKind(ServerKind):
    """Not yet known (a caller that did not probe): keeps every kind's per-response objects and reads the first
    clock one of them finds."""

    name = "any"

    @property
    def event_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(k for kind in kinds() for k in kind.event_keys)

    def request_clock(self, resp) -> RequestClock | None:
        return next((c for kind in kinds() if (c := kind.request_clock(resp)) is not None), None)


ANY = AnyKind()
