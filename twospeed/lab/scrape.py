"""The server's own view from its Prometheus /metrics: scraped before and after a run (the aggregate split
of any server that exposes one, vLLM's or twospeed's) and sampled during it for tokens per engine step.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

STEP_TOKENS = "twospeed_step_tokens"
CACHED_BLOCKS = "twospeed_kv_cache_cached_blocks"


def parse(text: str) -> dict[str, float]:
    """Samples summed over labels, except `kind` for twospeed's step_tokens (prefill/decode kept apart).
    Counters keep their `_total`, histograms their `_sum`/`_count`; buckets are dropped, before the parser sees
    them: a twospeed exposition is ~85% bucket lines, and parsing them all took the lab's process ~0.15-0.27 s of a
    core every scrape, a co-tenant that slowed the very steps it measured (11x less CPU without them)."""
    text = "\n".join(line for line in text.split("\n") if "_bucket{" not in line)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            name = s.name
            if s.name.startswith(STEP_TOKENS) and "kind" in s.labels:
                name = f"{s.name}{{kind={s.labels['kind']}}}"
            out[name] = out.get(name, 0.0) + s.value
    return out


async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    """/metrics next to the API root (URL without /v1); None when the server has none."""
    try:
        r = await client.get(base.removesuffix("/v1") + "/metrics", timeout=10)
        return parse(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def delta(before: dict | None, after: dict | None) -> dict | None:
    """after - before for monotone series (counters and histogram sums); gauges as they are after."""
    if before is None or after is None:
        return None
    return {k: (v - before.get(k, 0.0) if k.endswith(("_total", "_sum", "_count")) else v) for k, v in after.items()}


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
