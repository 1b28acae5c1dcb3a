"""/dashboard and /dashboard/clock in a real headless Chromium (Debian's `chromium`, driven by playwright's Python
API; no browser is downloaded), against a real `twospeed serve` with an API key, after traffic on two lanes.

Checked: the page updates live and its numbers equal /metrics (cached prompt tokens, KV usage and the blocks
and MiB cached prefixes hold: exactly; TTFT p99 per lane: exactly the p99 of the responses' own clocks, and
within one bucket of histogram_quantile over /metrics' buckets, see `hq_tolerance`); it asks no host but the
server; it works behind the key (the browser sends it as a Basic password); the clock page computes what
`twospeed clock` computes. A screenshot of each page is saved in the test's temp folder. Without a Chromium
(or playwright) the browser tests skip and say why; .ci/run installs both.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import pytest
from test_dashboard import histogram_quantile, hq_tolerance
from browser_harness import CHROMIUM, FLAGS, why_no_browser
from server_harness import ServerProcess, metric_sum, parse_metrics

from twospeed.engine.request import percentile
from twospeed.plan.clock import ToyClock

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LANES = ("chat", "batch")
PER_LANE = 8


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--slo", "chat:ttft_p99=30s,itl_p99=10s", "--slo", "batch:ttft=1us",
                        "--price", "1,0.1,4", "--max-waiting", "500")
    yield srv
    srv.stop_clean()


def metrics(server) -> dict:
    r = httpx.get(f"{server.base}/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200
    return parse_metrics(r.text)


def wait_idle(server, timeout: float = 60.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if metric_sum(m, "twospeed_num_requests_running") + metric_sum(m, "twospeed_num_requests_waiting") == 0 \
                and metric_sum(m, "twospeed_kv_cache_usage_ratio") == 0:
            return m
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def traffic(server) -> dict[str, list[dict]]:
    """PER_LANE completions on each lane, two at a time, sharing a prefix (so some prompt tokens are cached)."""
    def one(i: int) -> tuple[str, dict]:
        lane = LANES[i % 2]
        r = httpx.post(f"{server.url}/completions", headers=AUTH, timeout=120, json={
            "model": "demo", "prompt": "the shared instructions of both lanes " * 4 + f"and question {i}",
            "max_tokens": 6 + i % 5, "temperature": 0, "lane": lane})
        assert r.status_code == 200, r.text
        return lane, r.json()["twospeed"]

    out: dict[str, list[dict]] = {lane: [] for lane in LANES}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for lane, ts in pool.map(one, range(2 * PER_LANE)):
            out[lane].append(ts)
    return out


# -- auth: no browser needed -----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/data", "/dashboard/data?since=-60", "/dashboard/clock",
                                  "/dashboard/costs", "/dashboard/static/dashboard.js"])
def test_the_dashboard_needs_the_key(server, path):
    r = httpx.get(server.base + path, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"].startswith("Basic")  # so a browser asks for it
    assert httpx.get(server.base + path, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(server.base + path, headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(server.base + path, auth=("anyone", KEY), timeout=10).status_code == 200


def test_static_files_are_only_the_listed_ones(server):
    for name in ("..%2Fdashboard.html", "..%2F..%2Fconfig.py", "vendor%2F..%2Fcharts.js", "nope.js", "vendor"):
        assert httpx.get(f"{server.base}/dashboard/static/{name}", headers=AUTH, timeout=10).status_code == 404
    lic = httpx.get(f"{server.base}/dashboard/static/vendor/uPlot.LICENSE", headers=AUTH, timeout=10)
    assert lic.status_code == 200 and "MIT" in lic.text


# -- the browser -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium for the module, with the key as HTTP credentials; every URL it asks for is recorded."""
    why = why_no_browser()
    if why:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 1000}, http_credentials={"username": "me", "password": KEY})
        ctx.requested = []
        ctx.on("request", lambda req: ctx.requested.append(req.url))
        yield ctx
        ctx.close()


def non_loopback(urls: list[str]) -> list[str]:
    return [u for u in urls if not u.startswith("data:") and urlsplit(u).hostname not in ("127.0.0.1", "localhost")]


def cell(page, table: str, lane: str, col: str) -> float:
    value = page.get_attribute(f"#{table} tr[data-lane='{lane}'] td[data-col='{col}']", "data-value")
    assert value is not None, (table, lane, col)
    return float(value)


def test_the_dashboard_shows_what_metrics_says(server, traffic, browser, tmp_path):
    after = wait_idle(server)
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server.base}/dashboard")
    # live: wait for two updates after the traffic, with every sequence of both lanes in the table
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 2", timeout=30_000)
    for lane in LANES:
        page.wait_for_selector(f"#lanes tr[data-lane='{lane}'] td[data-col='n'][data-value='{PER_LANE}']",
                               timeout=30_000)
    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000

    for lane in LANES:
        shown = cell(page, "lanes", lane, "ttft_p99")
        ttfts = [t["clock"]["ttft_ms"] / 1e3 for t in traffic[lane]]
        assert shown == pytest.approx(percentile(sorted(ttfts), 99), abs=2e-6)  # the responses' own clocks
        buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in after.items()
                         if n == "twospeed_time_to_first_token_seconds_bucket" and dict(ls)["lane"] == lane)
        assert abs(shown - histogram_quantile(0.99, buckets)) <= hq_tolerance(ttfts), lane
    cached = metric_sum(after, "twospeed_prompt_tokens_total", kind="cached")
    assert cached > 0 and cell(page, "bill", "all", "cached_tokens") == cached
    for lane in LANES:
        assert cell(page, "bill", lane, "cached_tokens") == metric_sum(after, "twospeed_prompt_tokens_total",
                                                                       kind="cached", lane=lane)
        assert cell(page, "bill", lane, "goodput_tokens") == metric_sum(after, "twospeed_goodput_tokens_total",
                                                                        lane=lane)
    tile = lambda name: float(page.get_attribute(f"#tile-{name}", "data-value"))  # noqa: E731
    now = metrics(server)  # idle: nothing moves between the page's last poll and this scrape
    assert tile("kv_usage") == metric_sum(now, "twospeed_kv_cache_usage_ratio")
    blocks = metric_sum(now, "twospeed_kv_cache_cached_blocks")
    assert blocks > 0 and tile("cached_blocks") == blocks
    assert tile("cached_mib") == blocks * metric_sum(now, "twospeed_kv_cache_block_bytes")
    # while it ran the KV pool was in use: the steps behind the KV chart saw it
    assert page.evaluate("Math.max(...TWOSPEED_STATE.steps.kv_blocks_used)") > 0
    # the SLO table: the impossible lane missed every request, with a cause
    assert cell(page, "slo", "batch", "attainment") == 0.0 and cell(page, "slo", "chat", "attainment") == 1.0
    assert sum(cell(page, "slo", "batch", c) for c in ("queue", "prefill")) == PER_LANE
    assert page.locator("#requests tbody tr").count() == 2 * PER_LANE
    assert not errors, errors
    assert non_loopback(browser.requested) == []
    page.close()


CASES = "128:512 2000:200 8000:50 1:1 7:2"


def test_the_clock_page_computes_what_twospeed_clock_computes(server, browser, tmp_path):
    page = browser.new_page()
    page.goto(f"{server.base}/dashboard/clock?cases={CASES.replace(' ', '+')}&b=4.1e-5")
    page.wait_for_function("Number(document.body.dataset.computed || 0) >= 1", timeout=30_000)
    shown = {k: float(page.input_value(f"#{k}")) for k in ("a", "b", "step", "per_cached_token")}
    assert shown == {**{k: getattr(ToyClock(), k) for k in shown}, "b": 4.1e-5}  # the toy's defaults, but b
    ours = json.loads(subprocess.run([sys.executable, "-m", "twospeed.cli", "clock", *CASES.split(), "--b", "4.1e-5",
                                      "--json"], capture_output=True, text=True, check=True).stdout)
    for case in ours["cases"]:
        row = f"#out tr[data-case='{case['prompt_tokens']}:{case['output_tokens']}']"
        for key in ("prefill_s", "decode_s", "itl_mean_s", "itl_last_s", "total_s", "decode_share"):
            value = float(page.get_attribute(f"{row} td[data-col='{key}']", "data-value"))
            assert math.isclose(value, case[key], rel_tol=1e-12, abs_tol=1e-15), (case, key)
    page.screenshot(path=str(tmp_path / "clock.png"), full_page=True)

    # the toggle: this server's calibrated costs, fetched once, or the reason there are none
    costs = httpx.get(f"{server.base}/dashboard/costs", headers=AUTH, timeout=10).json()
    page.click("#live")  # not page.check: without costs the page unchecks it at once, and check() would see no change
    if costs["available"]:
        page.wait_for_function("document.getElementById('source').textContent.includes('fetched once')")
        clock = ToyClock(*(costs["toy"][k] for k in ("a", "b", "step", "per_cached_token")))
        value = float(page.get_attribute("#out tr[data-case='2000:200'] td[data-col='prefill_s']", "data-value"))
        assert value == pytest.approx(costs["toy"]["prefill_fixed"] + clock.prefill_time(2000), rel=1e-9)
    else:
        page.wait_for_function("document.getElementById('source').textContent.includes('no calibrated')")
        assert not page.is_checked("#live")
    assert non_loopback(browser.requested) == []
    page.close()


def test_panels_for_speculation_and_the_step_cost_model_slot_in(server, traffic, browser):
    """Fields other engines' features add (the cost model's predicted step time, target and prompt budget per
    step; speculation's proposed/accepted tokens per request) get their panels when the data has them."""
    data = httpx.get(f"{server.base}/dashboard/data", headers=AUTH, timeout=10).json()
    n = len(data["steps"]["t"])
    data["steps"].update(predicted_time=[0.02] * n, target_time=[0.05] * n, prefill_budget=[32] * n)
    for r in data["requests"]:
        r["bill"].update(spec_proposed=8, spec_accepted=6)
    for t in data["totals"].values():
        t.update(spec_proposed=80, spec_accepted=60)
    page = browser.new_page()
    page.add_init_script(f"window.TWOSPEED_STATIC = {json.dumps(data)};")
    page.goto(f"{server.base}/dashboard")
    page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1", timeout=30_000)
    legends = page.locator(".u-legend .u-label").all_inner_texts()
    assert {"predicted ms", "target ms", "prefill budget"} <= set(legends)
    assert cell(page, "bill", "all", "spec_accepted") == 60 * len(data["totals"])
    assert cell(page, "bill", "chat", "spec_acceptance") == 0.75
    assert "spec accepted/proposed" in page.locator("#requests thead").inner_text()
    assert page.locator("#tile-cost_error").count() == 1
    page.close()
