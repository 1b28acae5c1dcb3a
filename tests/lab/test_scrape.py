"""The server's view: /metrics parsed and differenced, tokens per step between samples, and the client's lag
verdict (it must say when the client, not the server, fell behind)."""

import pytest

from twospeed.lab import scrape
from twospeed.lab.bench import client_lag

BEFORE = """# TYPE twospeed_generation_tokens counter
twospeed_generation_tokens_total{lane="a",model="demo"} 10.0
twospeed_generation_tokens_total{lane="b",model="demo"} 5.0
# TYPE twospeed_step_tokens histogram
twospeed_step_tokens_bucket{kind="prefill",model="demo",le="+Inf"} 2.0
twospeed_step_tokens_sum{kind="prefill",model="demo"} 512.0
twospeed_step_tokens_count{kind="prefill",model="demo"} 2.0
twospeed_step_tokens_sum{kind="decode",model="demo"} 40.0
twospeed_step_tokens_count{kind="decode",model="demo"} 20.0
# TYPE twospeed_kv_cache_cached_blocks gauge
twospeed_kv_cache_cached_blocks{model="demo"} 3.0
"""
AFTER = (BEFORE.replace("} 10.0", "} 30.0").replace("512.0", "1024.0").replace('"prefill",model="demo"} 2.0',
                                                                               '"prefill",model="demo"} 4.0')
         .replace("40.0", "100.0").replace("} 20.0", "} 50.0").replace("} 3.0", "} 7.0"))


def test_parse_and_delta():
    before, after = scrape.parse(BEFORE), scrape.parse(AFTER)
    assert before["twospeed_generation_tokens_total"] == 15.0  # labels summed
    assert "twospeed_step_tokens_bucket" not in before
    d = scrape.delta(before, after)
    assert d["twospeed_generation_tokens_total"] == 20.0
    assert d["twospeed_kv_cache_cached_blocks"] == 7.0  # a gauge: its value after, not a difference
    assert scrape.delta(None, after) is None and scrape.is_twospeed(after) and not scrape.is_twospeed({"x": 1})


def test_parse_of_a_whole_exposition_equals_the_parsers_own_sums():
    """Buckets are dropped before parsing: every other sample summed exactly as a full parse would."""
    from prometheus_client.parser import text_string_to_metric_families

    from twospeed.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", lanes=("default", "chat"))
    for i in range(50):
        metrics.ttft.labels("chat", "m").observe(0.01 * i)
        metrics.step_tokens.labels("prefill", "m").observe(i)
    text = metrics.render().decode()
    full: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                name = f"{s.name}{{kind={s.labels['kind']}}}" if s.name.startswith(scrape.STEP_TOKENS) else s.name
                full[name] = full.get(name, 0.0) + s.value
    assert scrape.parse(text) == full and full["twospeed_time_to_first_token_seconds_count"] == 50


def test_tokens_per_step_between_samples():
    p = scrape.step_point(1.5, scrape.parse(BEFORE), scrape.parse(AFTER))
    assert p["prefill_tokens_per_step"] == pytest.approx(512 / 2)  # (1024 - 512) / (4 - 2)
    assert p["decode_tokens_per_step"] == pytest.approx(60 / 30)
    assert p["t_s"] == 1.5 and p["steps"] == 30
    idle = scrape.step_point(2.0, scrape.parse(AFTER), scrape.parse(AFTER))
    assert idle["prefill_tokens_per_step"] is None and idle["steps"] == 0
    assert scrape.step_point(0, {}, {"vllm:x_total": 1.0}) is None


def test_client_lag():
    on_time = client_lag([0.001] * 200, 0.05)
    assert not on_time["fell_behind"] and on_time["late_requests"] == 0
    behind = client_lag([0.001] * 195 + [0.2] * 5, 0.05)
    assert behind["fell_behind"] and behind["late_requests"] == 5 and behind["lag_max_s"] == 0.2
    assert not client_lag([0.001] * 199 + [0.2], 0.05)["fell_behind"]  # 0.5% late: within the allowance
    assert not client_lag([], 0.05)["fell_behind"]
