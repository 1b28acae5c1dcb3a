"""The server's own view from its Prometheus /metrics: scraped before and after a run (the aggregate split
of any server that exposes one, vLLM's or twospeed's) and sampled during it for tokens per engine step.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from twospeed.lab.server_kind import HistogramStat

STEP_TOKENS = "twospeed_step_tokens"
CACHED_BLOCKS = "twospeed_kv_cache_cached_blocks"


def parse(text: str, buckets: tuple[str, ...] = ()) -> dict[str, float]:
    """Samples summed over labels, except `kind` for twospeed's step_tokens (prefill/decode kept apart).
    Counters keep their `_total`, histograms their `_sum`/`_count`; buckets are dropped, before the parser sees
    them: a twospeed exposition is ~85% bucket lines, and parsing them all took the lab's process ~0.15-0.27 s of a
    core every scrape, a co-tenant that slowed the very steps it measured (11x less CPU without them). The
    histogram families named in `buckets` keep theirs, as `<family>_bucket{le=<bound>}` (a peer's clock is read
    from their percentiles)."""
    keep = tuple(f"{b}_bucket{{" for b in buckets)
    text = "\n".join(line for line in text.split("\n") if "_bucket{" not in line or line.startswith(keep))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            name = s.name
            if s.name.endswith("_bucket"):
                name = f"{s.name}{{le={s.labels.get('le')}}}"
            elif s.name.startswith(STEP_TOKENS) and "kind" in s.labels:
                name = f"{s.name}{{kind={s.labels['kind']}}}"
            out[name] = out.get(name, 0.0) + s.value
    return out


async def scrape(client: httpx.AsyncClient, base: str, buckets: tuple[str, ...] = ()) -> dict[str, float] | None:
    """/metrics next to the API root (URL without /v1); None when the server has none."""
    try:
        r = await client.get(base.removesuffix("/v1") + "/metrics", timeout=10)
        return parse(r.text, buckets) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _monotone(key: str) -> bool:
    return key.endswith(("_total", "_sum", "_count")) or "_bucket{le=" in key


def delta(before: dict | None, after: dict | None) -> dict | None:
    """after - before for monotone series (counters, histogram sums, counts and buckets); gauges as they are
    after."""
    if before is None or after is None:
        return None
    return {k: (v - before.get(k, 0.0) if _monotone(k) else v) for k, v in after.items()}


def histogram(d: dict | None, family: str) -> HistogramStat | None:
    """A histogram family over the run from a delta: count, sum, and the bucket bounds its p50/p90/p99 fall under
    when its buckets were kept (None when the family is not there)."""
    if not d or f"{family}_count" not in d:
        return None
    count, total = d[f"{family}_count"], d.get(f"{family}_sum", 0.0)
    prefix = f"{family}_bucket{{le="
    cumulative = sorted((float(k[len(prefix):-1]), v) for k, v in d.items() if k.startswith(prefix))
    q = {p: bucket_bound(cumulative, p / 100) for p in (50, 90, 99)} if cumulative and count > 0 else {}
    return HistogramStat(count, total, q.get(50), q.get(90), q.get(99))


def bucket_bound(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket the q-quantile falls in, from cumulative (upper bound, count) buckets: what a
    histogram says for sure (at least q of the values are at most it). Not interpolated inside the bucket: vLLM's
    first queue bucket is 0.3 s, so a linear guess reads 34 µs queues as 150 ms. None when it falls past the
    largest finite bound."""
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    for bound, cum in cumulative:
        if cum >= rank:
            return None if math.isinf(bound) else bound
    return None


def is_twospeed(sample: dict | None) -> bool:
    return bool(sample) and any(k.startswith("twospeed_") for k in sample)


def step_point(t: float, prev: dict, cur: dict) -> dict | None:
    """Mean tokens per engine step by kind between two samples (None when the server has no such series)."""
    keys = {kind: (f"{STEP_TOKENS}_sum{{kind={kind}}}", f"{STEP_TOKENS}_count{{kind={kind}}}")
            for kind in ("prefill", "decode")}
    if not any(k[0] in cur for k in keys.values()):
        return None
    point: dict = {"t_s": t, "steps": 0.0}
    for kind, (s, c) in keys.items():
        ds, dc = cur.get(s, 0.0) - prev.get(s, 0.0), cur.get(c, 0.0) - prev.get(c, 0.0)
        point[f"{kind}_tokens_per_step"] = ds / dc if dc > 0 else None
        point["steps"] = max(point["steps"], dc)
    return point


async def sample_timeline(client: httpx.AsyncClient, base: str, start: float, out: list, stop: asyncio.Event,
                          period: float = 0.5) -> None:
    """Append a step_point every `period` seconds until `stop` is set."""
    prev = await scrape(client, base)
    if not is_twospeed(prev):
        return
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), period)
        except asyncio.TimeoutError:
            pass
        cur = await scrape(client, base)
        if cur is None:
            return
        point = step_point(time.perf_counter() - start, prev, cur)
        if point is not None:
            out.append(point)
        prev = cur
