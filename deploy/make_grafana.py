"""Writes deploy/grafana-dashboard.json: the panels of twospeed's /dashboard as a Grafana dashboard.

Run `python deploy/make_grafana.py` after editing PANELS; tests/server/test_prometheus.py checks that the JSON is what
this script writes and that every query in it returns data from a real Prometheus scraping a real server.
Queries use the recording rules of deploy/twospeed.rules.yml where one exists. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LANE = '{lane=~"$lane"}'
RI = "$__rate_interval"

# (row title, [(panel title, unit, [(legend, PromQL)], kind)]); kind: "timeseries" or "heatmap"
PANELS = [
    ("Prefill (TTFT, with its queue) and decode (ITL) per lane", [
        ("TTFT p50 / p99 and queue p99", "s", [
            ("{{lane}} TTFT p99", f"lane:twospeed_time_to_first_token_seconds:p99_1m{LANE}"),
            ("{{lane}} TTFT p50", f"lane:twospeed_time_to_first_token_seconds:p50_1m{LANE}"),
            ("{{lane}} queue p99", f"lane:twospeed_request_queue_time_seconds:p99_1m{LANE}")], "timeseries"),
        ("ITL p50 / p99", "s", [
            ("{{lane}} ITL p99", f"lane:twospeed_inter_token_latency_seconds:p99_1m{LANE}"),
            ("{{lane}} ITL p50", f"lane:twospeed_inter_token_latency_seconds:p50_1m{LANE}")], "timeseries"),
        ("TTFT distribution", "s", [
            ("{{le}}", f"sum by (le) (rate(twospeed_time_to_first_token_seconds_bucket{LANE}[{RI}]))")], "heatmap"),
        ("ITL distribution", "s", [
            ("{{le}}", f"sum by (le) (rate(twospeed_inter_token_latency_seconds_bucket{LANE}[{RI}]))")], "heatmap"),
    ]),
    ("Engine: tokens per step, load", [
        ("Tokens/s by kind (prefill vs decode)", "short", [("{{kind}}", "kind:twospeed_step_tokens:rate1m")],
         "timeseries"),
        ("Tokens per step by kind", "short", [
            ("{{kind}}", f"sum by (kind) (rate(twospeed_step_tokens_sum[{RI}])) / "
                         f"sum by (kind) (rate(twospeed_step_tokens_count[{RI}]))")], "timeseries"),
        ("Running / waiting sequences", "short", [
            ("{{lane}} running", f"sum by (lane) (twospeed_num_requests_running{LANE})"),
            ("{{lane}} waiting", f"sum by (lane) (twospeed_num_requests_waiting{LANE})")], "timeseries"),
        ("Preemptions/s", "short", [
            ("{{lane}}", f"sum by (lane) (rate(twospeed_num_preemptions_total{LANE}[{RI}]))")], "timeseries"),
    ]),
    ("KV pool and prefix cache", [
        ("KV blocks in use and held by cached prefixes (share of the pool)", "percentunit", [
            ("in use", "sum(twospeed_kv_cache_usage_ratio)"),
            ("cached prefixes", "sum(twospeed_kv_cache_cached_blocks) / sum(twospeed_kv_cache_num_blocks)")],
         "timeseries"),
        ("Memory held by cached prefixes", "bytes", [
            ("cached prefixes", "sum(twospeed_kv_cache_cached_blocks * twospeed_kv_cache_block_bytes)")],
         "timeseries"),
        ("Prefix cache hit rate (prompt tokens)", "percentunit", [
            ("{{lane}}", f"lane:twospeed_prefix_cache_hit_ratio:rate1m{LANE}")], "timeseries"),
    ]),
    ("The split bill", [
        ("Tokens/s billed by kind", "short", [
            ("prompt {{kind}}", f"sum by (kind) (rate(twospeed_prompt_tokens_total{LANE}[{RI}]))"),
            ("output", f"sum(rate(twospeed_generation_tokens_total{LANE}[{RI}]))"),
            ("forced", f"sum(rate(twospeed_forced_tokens_total{LANE}[{RI}]))"),
            ("recomputed", f"sum(rate(twospeed_recomputed_tokens_total{LANE}[{RI}]))"),
            ("goodput", f"sum(lane:twospeed_goodput_tokens:rate1m{LANE})")], "timeseries"),
        ("Cost per hour at the --price table", "currencyUSD", [
            ("$/h", "3600 / 1e6 * ("
                    f'sum(rate(twospeed_prompt_tokens_total{{kind="prefilled",lane=~"$lane"}}[{RI}])) * '
                    'scalar(twospeed_price_per_million_tokens{kind="input"}) + '
                    f'sum(rate(twospeed_prompt_tokens_total{{kind="cached",lane=~"$lane"}}[{RI}])) * '
                    'scalar(twospeed_price_per_million_tokens{kind="cached_input"}) + '
                    f"sum(rate(twospeed_generation_tokens_total{LANE}[{RI}])) * "
                    'scalar(twospeed_price_per_million_tokens{kind="output"}))')], "timeseries"),
    ]),
    ("SLOs", [
        ("SLO attainment per lane", "percentunit", [
            ("{{lane}}", f"lane:twospeed_slo_attainment:ratio_rate5m{LANE}")], "timeseries"),
        ("SLO misses/s by cause", "short", [
            ("{{lane}} {{cause}}",
             f'sum by (lane, cause) (rate(twospeed_slo_requests_total{{result="missed",lane=~"$lane"}}[{RI}]))')],
         "timeseries"),
    ]),
]


def panel(pid: int, title: str, unit: str, targets: list, kind: str, x: int, y: int) -> dict:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    p = {"id": pid, "type": kind, "title": title, "datasource": ds, "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(65 + i), "datasource": ds, "expr": expr, "legendFormat": legend,
                      **({"format": "heatmap"} if kind == "heatmap" else {})}
                     for i, (legend, expr) in enumerate(targets)]}
    if kind == "heatmap":
        p["options"] = {"calculate": False, "yAxis": {"unit": unit}, "cellGap": 1}
    return p


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for row, items in PANELS:
        panels.append({"id": pid, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, item in enumerate(items):
            panels.append(panel(pid, *item, x=12 * (i % 2), y=y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(items) + 1) // 2)
    lane_var = {"name": "lane", "type": "query", "label": "lane", "multi": True, "includeAll": True, "allValue": ".*",
                "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 2,
                "query": {"query": "label_values(twospeed_time_to_first_token_seconds_count, lane)", "refId": "lanes"},
                "current": {"text": "All", "value": "$__all"}}
    return {"title": "twospeed: both speeds", "uid": "twospeed-both-speeds", "schemaVersion": 39, "version": 1,
            "editable": True, "refresh": "5s", "time": {"from": "now-30m", "to": "now"}, "tags": ["twospeed", "llm"],
            "description": "Prefill (TTFT) and decode (ITL) apart per lane, tokens per step, the KV pool, the split "
                           "bill and SLOs; the same panels as twospeed's /dashboard.",
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus"}, lane_var]},
            "panels": panels}


def main() -> int:
    out = Path(__file__).with_name("grafana-dashboard.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
