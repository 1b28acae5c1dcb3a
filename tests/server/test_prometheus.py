"""twospeed's /metrics as Prometheus sees it: `promtool check metrics` passes on it, and a real Prometheus (Debian's
`prometheus`, on a free loopback port with its storage in the test's temp folder) scrapes a real server with
deploy/'s config and rules; after traffic on two lanes every recording rule and every PromQL query of the
Grafana dashboard returns data, and histogram_quantile(0.99) of a lane's TTFT lands near the exact p99 of the
same requests (their own clocks). deploy/grafana-dashboard.json must be what deploy/make_grafana.py writes.
The server runs with --api-key and --metrics-public: /metrics and /dashboard open, the API keyed.
Skips, saying why, where the prometheus package is not installed (.ci/run installs it).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from test_dashboard import hq_tolerance
from server_harness import ServerProcess

from twospeed.engine.request import percentile

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEY = "prom-key"
LANES = {"chat": 24, "batch": 8}  # requests per lane


def _tool(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    if not Path(path).exists():
        pytest.skip(f"no {name} (Debian: apt-get install prometheus; .ci/run does)")
    return path


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--metrics-public", "--slo", "chat:ttft_p99=30s,itl_p99=10s",
                        "--slo", "batch:ttft=1us", "--price", "1,0.1,4")
    yield srv
    srv.stop_clean()


def test_grafana_json_is_what_make_grafana_writes():
    sys.path.insert(0, str(DEPLOY))
    try:
        import make_grafana
    finally:
        sys.path.pop(0)
    assert json.loads((DEPLOY / "grafana-dashboard.json").read_text()) == make_grafana.dashboard()


def test_metrics_public_opens_metrics_and_dashboard_but_not_the_api(server):
    assert httpx.get(f"{server.base}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{server.base}/dashboard/data?since=-1", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/models", timeout=10).status_code == 401


def test_promtool_check_metrics_passes(server):
    promtool = _tool("promtool")
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    assert "twospeed:" not in text
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """deploy/'s config pointed at the server, scraping and evaluating every second."""
    binary = _tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"] = [{"targets": [server.base.removeprefix("http://")]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(DEPLOY / "twospeed.rules.yml", work / "twospeed.rules.yml")
    port = _free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get(f"{base}/-/ready") == 200, 60, "prometheus did not get ready", work)
        wait_for(lambda: query(base, 'up{job="twospeed"}') == [1.0], 60, "the server's target never came up", work)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def query(base: str, expr: str) -> list[float]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return [float(s["value"][1]) for s in r.json()["data"]["result"]]


def wait_for(check, timeout: float, message: str, work: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            log = (work / "prometheus.log").read_text() if work else ""
            raise AssertionError(f"{message}\n{log[-2000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def traffic(server, prometheus) -> dict[str, list[float]]:
    """Completions on two lanes, two at a time; returns each lane's TTFTs as the responses' clocks say."""
    order = [lane for lane, n in LANES.items() for _ in range(n)]

    def one(i: int) -> tuple[str, float]:
        lane = order[i]
        r = httpx.post(f"{server.url}/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120, json={
            "model": "demo", "prompt": "a prompt the lanes share " * 3 + f"#{i}", "max_tokens": 4 + i % 4,
            "temperature": 0, "lane": lane})
        assert r.status_code == 200, r.text
        return lane, r.json()["twospeed"]["clock"]["ttft_ms"] / 1e3

    out: dict[str, list[float]] = {lane: [] for lane in LANES}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for lane, ttft in pool.map(one, range(len(order))):
            out[lane].append(ttft)
    return out


def recording_rules() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "twospeed.rules.yml").read_text())
    return [r["record"] for g in rules["groups"] for r in g["rules"]]


def grafana_queries() -> list[str]:
    doc = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    return [e.replace("$lane", ".*").replace("$__rate_interval", "1m") for e in exprs]


def test_every_recording_rule_and_grafana_query_returns_data(prometheus, traffic):
    exprs = recording_rules() + grafana_queries()
    assert len(exprs) > 20
    missing: list[str] = []

    def all_answer() -> bool:
        missing[:] = [e for e in exprs if not any(math.isfinite(v) for v in query(prometheus, e))]
        return not missing

    try:
        wait_for(all_answer, 60, "")
    except AssertionError:
        pytest.fail(f"no data after traffic for: {missing}")
    # per lane where the rule is per lane: both lanes answer
    for rule in ("lane:twospeed_time_to_first_token_seconds:p99_1m",
                 "lane:twospeed_inter_token_latency_seconds:p99_1m"):
        for lane in LANES:
            assert query(prometheus, f'{rule}{{lane="{lane}"}}'), (rule, lane)
    # every batch sequence missed its 1 us TTFT objective: 0, once a rule evaluation has seen the lane's requests
    # (before, its rate is 0 / 0; the chat lane's number already passed the wait above on a fast machine)
    batch = 'lane:twospeed_slo_attainment:ratio_rate5m{lane="batch"}'
    wait_for(lambda: all(math.isfinite(v) for v in query(prometheus, batch) or [math.nan]), 60, "batch attainment")
    assert query(prometheus, batch) == [0.0]


def test_histogram_quantile_p99_is_near_the_exact_p99_of_the_same_requests(prometheus, traffic):
    for lane, ttfts in traffic.items():
        expr = (f'histogram_quantile(0.99, sum by (le) (twospeed_time_to_first_token_seconds_bucket{{lane="{lane}"}}))')
        wait_for(lambda: query(prometheus, f'sum(twospeed_time_to_first_token_seconds_count{{lane="{lane}"}})')
                 == [float(len(ttfts))], 30, f"Prometheus has not scraped every {lane} request")
        (estimate,) = query(prometheus, expr)
        exact = percentile(sorted(ttfts), 99)
        assert abs(estimate - exact) <= hq_tolerance(ttfts), (lane, estimate, exact)
