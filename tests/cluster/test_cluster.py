"""Scale-out on Ray Serve, end to end: one local Ray for the session (loopback only), two demo replicas of one
thread each, a prefix-routing ingress and a round-robin ingress attached to the same replicas, and a single
`twospeed serve` beside them as the reference. The official openai client gets the same greedy outputs from
both; an agent session's turns stay on one replica under prefix routing (cached tokens grow turn by turn) and
scatter under round-robin; route_time is in every clock and inside queue_time; a bad request gets the single
server's 400 at the ingress and reaches no replica; the merged /metrics parse and equal the replicas' own;
killing a replica's actor mid-stream ends only its streams, with an error event, and Ray Serve brings it back.

Skipped only when ray[serve] cannot be imported (`pip install 'twospeed[cluster]'`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from twospeed.cluster import keep_ray_on_loopback

keep_ray_on_loopback()  # before ray is imported
ray = pytest.importorskip("ray", reason="the cluster tests need Ray Serve: pip install 'twospeed[cluster]'")
serve = pytest.importorskip("ray.serve", reason="the cluster tests need Ray Serve: pip install 'twospeed[cluster]'")

from server_harness import ENGINE, ServerProcess, parse_metrics, sse_events  # noqa: E402

from twospeed.cluster.config import ClusterConfig  # noqa: E402
from twospeed.cluster.deploy import WORKER_NICE, deploy, start_ray  # noqa: E402
from twospeed.config import EngineConfig  # noqa: E402
from twospeed.server.config import ServerConfig  # noqa: E402

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

APP, RR_APP = "twospeed", "rr"
REPLICAS = ["engine-0", "engine-1"]


class Cluster:
    def __init__(self, url: str, rr_url: str):
        self.url, self.rr_url = url, rr_url
        self.base, self.rr_base = url.removesuffix("/v1"), rr_url.removesuffix("/v1")

    def handle(self, name: str):
        return serve.get_deployment_handle(name, app_name=APP)

    def replica_metrics(self) -> dict[str, str]:
        return {name: self.handle(name).metrics.remote().result(timeout_s=30) for name in REPLICAS}

    def replicas(self, base: str | None = None) -> dict[str, dict]:
        r = httpx.get(f"{base or self.base}/cluster/replicas", timeout=30)
        assert r.status_code == 200
        return {x["name"]: x for x in r.json()["replicas"]}


@pytest.fixture(scope="module")  # Ray's idle processes take a fifth of a core: gone before the next module
def cluster():
    common = dict(replicas=2, replica_cpus=0.5, replica_threads=1, probe_interval=0.5)
    assert start_ray(ClusterConfig(**common))  # as `twospeed serve --replicas` starts it
    try:
        engine = EngineConfig.from_kwargs("demo", **ENGINE)
        server = ServerConfig(port=0, max_waiting=2000)
        url = deploy(engine, server, ClusterConfig(router="prefix", app_name=APP, **common))
        rr_url = deploy(engine, server, ClusterConfig(router="round-robin", app_name=RR_APP, attach_to=APP, **common))
        yield Cluster(url, rr_url)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single():
    srv = ServerProcess("--max-waiting", "2000")
    yield srv
    srv.stop_clean()


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def routed(cluster: Cluster, base: str | None = None) -> dict[str, int]:
    return {name: sum(r["routed"].values()) for name, r in cluster.replicas(base).items()}


# -- the same API --------------------------------------------------------------------------------------------
def test_health_models_and_identical_greedy_outputs(cluster, single):
    assert httpx.get(f"{cluster.base}/health", timeout=30).status_code == 200
    ours, theirs = openai_client(cluster.url), openai_client(single.url)
    assert [m.id for m in ours.models.list().data] == ["demo"]
    prompts = ["The two speeds of a token", "prefill decode " * 20, "a"]
    for stream in (False, True):
        for prompt in prompts:
            kw = dict(model="demo", prompt=prompt, max_tokens=12, temperature=0)
            if stream:
                texts = ["".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
                         for client in (ours, theirs)]
                assert texts[0] == texts[1]
            else:
                a, b = ours.completions.create(**kw), theirs.completions.create(**kw)
                assert (a.choices[0].text, a.usage.completion_tokens, a.choices[0].finish_reason) == \
                       (b.choices[0].text, b.usage.completion_tokens, b.choices[0].finish_reason)
    messages = [{"role": "user", "content": "What sets time to first token?"}]
    a, b = (c.chat.completions.create(model="demo", messages=messages, max_tokens=10, temperature=0, n=2)
            for c in (ours, theirs))
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]


def test_a_bad_request_gets_the_single_servers_400_at_the_ingress(cluster, single):
    bodies = [{"prompt": "x " * 400, "max_tokens": 4},  # longer than max_model_len
              {"prompt": [1, 2, 99999], "max_tokens": 4},  # a token id outside the vocabulary
              {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [10 ** 6]},
              {"prompt": "hi", "max_tokens": 4, "logprobs": 10 ** 6},
              {"prompt": "hi", "max_tokens": 500},  # beyond the room the prompt leaves
              {"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
                  "name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
              {"prompt": "hi", "model": "nope"}]
    before = routed(cluster)
    for body in bodies:
        answers = [httpx.post(f"{base}/v1/completions", json={"model": "demo", **body}, timeout=60)
                   for base in (cluster.base, single.base)]
        assert answers[0].status_code == answers[1].status_code == 400, body
        assert answers[0].json() == answers[1].json()
    assert routed(cluster) == before  # refused before routing: no replica saw them


# -- routing ---------------------------------------------------------------------------------------------------
def agent_session(base: str, tag: str, turns: int = 4) -> list[tuple[str, int, int]]:
    """(replica, prompt tokens, cached tokens) per turn of one agent session whose prompt grows turn by turn."""
    history = f"[{tag}] You are a careful agent. " + "prefill decode token cache " * 6  # ~50 tokens
    out = []
    with httpx.Client(timeout=120) as client:
        for turn in range(turns):
            history += f"\nUser: step {turn} ({tag}): call the next tool."  # ~30 tokens, ~38 with the answer
            r = client.post(f"{base}/v1/completions", json={"model": "demo", "prompt": history, "max_tokens": 8,
                                                            "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            usage = body["usage"]
            out.append((r.headers["x-twospeed-replica"], usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"]))
            history += body["choices"][0]["text"]
    return out


def test_prefix_routing_keeps_a_session_on_its_replica_and_round_robin_does_not(cluster):
    turns = agent_session(cluster.base, "prefix-session")
    assert len({replica for replica, _, _ in turns}) == 1
    for (_, prev_prompt, _), (_, _, cached) in zip(turns, turns[1:]):
        assert cached >= prev_prompt // 16 * 16  # the whole previous prompt was found in the cache
    assert [c for _, _, c in turns] == sorted(c for _, _, c in turns) and turns[-1][2] > turns[1][2]

    rr = agent_session(cluster.rr_base, "rr-session")
    assert [replica for replica, _, _ in rr] in (REPLICAS * 2, REPLICAS[::-1] * 2)  # alternating
    misses = [cached < prev_prompt // 16 * 16 for (_, prev_prompt, _), (_, _, cached) in zip(rr, rr[1:])]
    assert all(misses)  # each turn landed where its previous turn was not
    assert sum(c for *_, c in turns) > 1.5 * sum(c for *_, c in rr)


def test_route_time_is_stamped_and_inside_the_queue(cluster):
    before = parse_metrics(httpx.get(f"{cluster.base}/metrics", timeout=30).text)
    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": "demo", "prompt": "route me", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200
    clocks = [r.json()["twospeed"]["clock"]]
    timing = dict(re.findall(r"(\w+);dur=([\d.]+)", r.headers["server-timing"]))
    assert float(timing["route"]) == pytest.approx(clocks[0]["route_ms"], abs=1e-3)
    with httpx.stream("POST", f"{cluster.base}/v1/completions", timeout=60, json={
            "model": "demo", "prompt": "route me again", "max_tokens": 4, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    clocks.append(next(e for e in events if e != "[DONE]" and "clock" in e["twospeed"])["twospeed"]["clock"])
    for clock in clocks:
        assert clock["route_ms"] > 0
        assert clock["queue_ms"] >= clock["route_ms"]  # the hop is part of the wait before the first step
        assert clock["ttft_ms"] >= clock["queue_ms"] + clock["prefill_ms"] - 1e-3  # ttft counts from the ingress
    after = parse_metrics(httpx.get(f"{cluster.base}/metrics", timeout=30).text)
    key = "twospeed_router_route_time_seconds_count"
    assert sum(v for (n, _), v in after.items() if n == key) - sum(v for (n, _), v in before.items() if n == key) == 2


# -- merged metrics and dashboard ----------------------------------------------------------------------------
def test_merged_metrics_equal_the_replicas_own(cluster):
    deadline = time.monotonic() + 60
    while any(r["in_flight"] for r in cluster.replicas().values()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    text = httpx.get(f"{cluster.base}/metrics", timeout=30).text
    merged = parse_metrics(text)  # prometheus_client's own parser
    own = cluster.replica_metrics()
    for name, replica_text in own.items():
        for (sample, labels), value in parse_metrics(replica_text).items():
            if sample.startswith(("twospeed_num_requests", "twospeed_kv_cache_usage")):
                continue  # gauges of the moment
            assert merged[(sample, tuple(sorted((*labels, ("replica", name)))))] == value, (name, sample, labels)
    generated = sum(v for (n, ls), v in merged.items() if n == "twospeed_generation_tokens_total")
    assert generated == sum(v for text in own.values() for (n, _), v in parse_metrics(text).items()
                            if n == "twospeed_generation_tokens_total") > 0
    routed_total = sum(v for (n, _), v in merged.items() if n == "twospeed_router_requests_total")
    assert routed_total == sum(routed(cluster).values())

    doc = httpx.get(f"{cluster.base}/dashboard/data", timeout=30).json()
    assert [r["name"] for r in doc["replicas"]] == REPLICAS
    histories = [cluster.handle(n).history.remote(None).result(timeout_s=30) for n in REPLICAS]
    for lane, totals in doc["totals"].items():
        for key, value in totals.items():
            assert value == sum(h["totals"].get(lane, {}).get(key, 0) for h in histories)
    assert {r["replica"] for r in doc["requests"]} <= set(REPLICAS)


def test_the_dashboard_shows_the_replicas(cluster, tmp_path_factory):
    from browser_harness import CHROMIUM, FLAGS, why_no_browser

    if why := why_no_browser():
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    replicas = cluster.replicas()
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium")), executable_path=CHROMIUM,
                                                   headless=True, args=FLAGS, viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{cluster.base}/dashboard")
        page.wait_for_function("Number(document.body.dataset.updates || 0) >= 2", timeout=30_000)
        page.screenshot(path=str(tmp_path_factory.mktemp("shots") / "cluster-dashboard.png"), full_page=True)
        for name, state in replicas.items():
            row = f"#replicas tr[data-replica='{name}']"
            routed_here = page.get_attribute(f"{row} td[data-col='routed']", "data-value")
            assert routed_here == str(sum(state["routed"].values()))
            assert page.inner_text(f"{row} td[data-col='up']") == "up"
            p50 = page.get_attribute(f"{row} td[data-col='route_p50']", "data-value")
            assert p50 is not None and float(p50) > 0  # from the sequences it served (their clocks' route time)
        ctx.close()
    assert not errors, errors


# -- faults (last: it restarts a replica) ------------------------------------------------------------------------
def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, niceness, command line) of every process here."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(fields[1]), int(fields[16]), cmd)
    return out


def _descendants(procs: dict[int, tuple[int, int, str]], root: int) -> set[int]:
    """The processes below root: the local Ray this test started is a child of pytest, so another test run's Ray
    cluster on the same machine is not counted."""
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads niceness from /proc")
def test_the_route_runs_above_the_engines(cluster):
    """The replica actors (the route's and the streams' end) run at the workers' niceness, not Ray's default 15,
    and each one's engine process ClusterConfig.engine_nice above it: a hop preempts a step."""
    procs = _processes()
    ours = _descendants(procs, os.getpid())
    replica = f"ServeReplica:{APP}:engine-"
    actors = {pid: nice for pid, (_, nice, cmd) in procs.items() if pid in ours and replica in cmd}
    assert len(actors) == 2 and set(actors.values()) == {WORKER_NICE}, actors
    engines = [nice for ppid, nice, cmd in procs.values() if ppid in actors and "engine_child" in cmd]
    assert engines == [WORKER_NICE + ClusterConfig().engine_nice] * 2, engines


def test_a_killed_replica_fails_only_its_streams_and_comes_back(cluster):
    streams: list[dict] = []

    def run(i: int) -> None:
        state = {"replica": None, "events": [], "tokens": 0}
        streams.append(state)
        with httpx.stream("POST", f"{cluster.base}/v1/completions", timeout=180, json={
                "model": "demo", "prompt": f"stream {i} " * 10, "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            state["replica"] = r.headers["x-twospeed-replica"]
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    state["events"].append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(streams) < 4 or any(len(s["events"]) < 3 for s in streams):  # every stream is under way
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    assert {s["replica"] for s in streams} == set(REPLICAS)  # least-loaded spread them
    victim = streams[0]["replica"]
    actor = cluster.replicas()[victim]["actor"]
    killed = time.monotonic()
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    for s in streams:
        assert s["events"][-1][1] == "[DONE]"
        last = s["events"][-2][1]
        if s["replica"] == victim:
            assert last["error"]["type"] == "service_unavailable" and victim in last["error"]["message"]
            assert s["events"][-2][0] - killed < 30  # ended with the error, not a hang
        else:  # the survivor's streams never noticed
            tokens = sum(e["twospeed"]["num_tokens"] for _, e in s["events"][:-1])
            assert tokens == 120 and last["choices"][0]["finish_reason"] == "length"

    r = httpx.post(f"{cluster.base}/v1/completions", json={"model": "demo", "prompt": "after", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200  # routed to the survivor (or to the restarted replica)
    deadline = time.monotonic() + 180
    while not (state := cluster.replicas()[victim])["up"] or state["restarts"] < 1:
        assert time.monotonic() < deadline, f"{victim} did not come back: {state}"
        time.sleep(0.5)
    assert state["lost"] == sum(s["replica"] == victim for s in streams)
    served = set()
    for _ in range(6):  # idle replicas tie: least-loaded rotates onto the restarted one
        r = httpx.post(f"{cluster.base}/v1/completions", json={"model": "demo", "prompt": "back", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200
        served.add(r.headers["x-twospeed-replica"])
    assert victim in served
