"""The lab end to end: `twospeed serve` on the demo model (a subprocess on a free loopback port), a short
`mixed` workload through `twospeed bench`, results.json checked against its schema, the client's TTFT
against the server's own, cached tokens in the agent lane, and `twospeed compare` on two runs."""

import csv
import json

import pytest

from twospeed.cli import main
from twospeed.lab import compare, results
from twospeed.lab.local_server import LocalServer

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

# Client TTFT (send -> first content token received) must be at least the server's (arrival -> first token
# sampled) and exceed it by at most HTTP and event-loop overhead: 0.5 s or half the client's TTFT, whichever
# is larger (the machine is shared, so the bound is loose; it still catches a wrong clock or a wrong chunk).
TTFT_SLACK_S = 0.005
TTFT_OVERHEAD_S = 0.5


@pytest.fixture(scope="module")
def server():
    from twospeed.builtin.demo import demo_checkpoint_path

    demo_checkpoint_path()
    with LocalServer("demo", ["--kv-cache-memory-gb", "0.1", "--max-num-batched-tokens", "256"]) as s:
        yield s


def _bench(server, out, salt, seed="0", label="a"):
    return main(["bench", "--url", server.url, "--model", "demo", "--workload", "mixed", "--requests", "10",
                 "--rate", "5", "--seed", seed, "--scale", "0.1", "--max-prompt-tokens", "1000",
                 "--max-output-tokens", "40", "--ignore-eos", "--tokenizer", "demo", "--salt", salt,
                 "--label", label, "--out", str(out), "--no-progress"])


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    assert _bench(server, root / "a", "e2e-a", label="a") == 0
    assert _bench(server, root / "b", "e2e-b", label="b") == 0
    return root


def test_results_follow_the_schema(runs):
    doc = json.loads((runs / "a" / "results.json").read_text())
    results.validate(doc)
    assert doc["run"]["server_kind"] == "twospeed" and doc["run"]["token_source"] == "twospeed"
    assert doc["total"]["requests"] == 10 and doc["total"]["errors"] == 0
    assert set(doc["lanes"]) <= {"agent", "rag", "chat", "nightly"} and len(doc["lanes"]) >= 3
    with open(runs / "a" / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10 and set(results.CSV_FIELDS) == set(rows[0])
    for name in ("report.html", "ttft_vs_prompt.png", "itl_vs_position.png", "cdf_ttft.png", "cdf_itl.png"):
        assert (runs / "a" / name).stat().st_size > 0
    assert doc["server"]["metrics_delta"]["twospeed_generation_tokens_total"] == doc["total"]["bill"]["output_tokens"]


def test_the_report_embeds_the_dashboards_views_offline(runs):
    import re

    from twospeed.lab.report_dashboard import dashboard_data

    doc = json.loads((runs / "a" / "results.json").read_text())
    page = (runs / "a" / "dashboard.html").read_text()
    assert 'src="dashboard.html"' in (runs / "a" / "report.html").read_text()
    assert not re.search(r'(src|href)="(?!data:)', page)  # everything inline: nothing to fetch, from anywhere
    assert "window.TWOSPEED_STATIC" in page and "uPlot" in page
    data = dashboard_data(doc)
    assert len(data["requests"]) == 10 and len(data["gaps"]["gap"]) == sum(len(r["itl_s"]) for r in doc["requests"])
    for lane, summary in doc["lanes"].items():
        for key in ("cached_tokens", "prefilled_tokens", "output_tokens", "goodput_tokens"):
            assert data["totals"][lane][key] == summary["bill"][key], (lane, key)
        judged = data["slo"].get(lane, {})
        if judged:  # lanes with objectives: met count as the lab judged it, every miss with the server's cause
            assert judged.get("met", 0) == summary["slo"]["met_requests"]
            assert set(judged) <= {"met", "queue", "prefill", "decode_interference", "decode", "preemption"}


def test_client_and_server_ttft_agree(runs):
    doc = json.loads((runs / "a" / "results.json").read_text())
    for r in doc["requests"]:
        assert r["server_ttft_s"] is not None
        if r["lane"] in ("chat", "rag"):  # unconstrained, ignore_eos: exactly the cap
            assert r["output_tokens"] == 40
        assert r["server_ttft_s"] <= r["ttft_s"] + TTFT_SLACK_S
        assert r["ttft_s"] - r["server_ttft_s"] <= max(TTFT_OVERHEAD_S, 0.5 * r["ttft_s"])
        assert len(r["itl_s"]) == r["output_tokens"] - 1


def test_structured_lanes_pass_their_gates(runs):
    """agent and nightly send their gate's schema as response_format: the server's constrained answers must
    pass the lab's json_schema gate (each answer fits its max_tokens here)."""
    doc = json.loads((runs / "a" / "results.json").read_text())
    constrained = [r for r in doc["requests"] if r["lane"] in ("agent", "nightly")]
    assert constrained and all(r["gate_passed"] for r in constrained if r["output_tokens"] < 40)
    assert any(r["gate_passed"] for r in constrained)
    assert not any(r["gate_passed"] for r in doc["requests"] if r["lane"] == "rag")  # random weights cite nothing


def test_agent_lane_hits_the_prefix_cache(runs):
    doc = json.loads((runs / "a" / "results.json").read_text())
    agent = doc["lanes"]["agent"]
    assert agent["requests"] >= 2 and agent["bill"]["cached_tokens"] > 0
    assert agent["bill"]["prefilled_tokens"] + agent["bill"]["cached_tokens"] == agent["bill"]["prompt_tokens"]
    assert doc["server"]["kv_memory"]["cached_blocks"] > 0


def test_compare_two_runs(runs, capsys):
    assert main(["compare", str(runs / "a"), str(runs / "b")]) == 0
    out = capsys.readouterr().out
    assert "lane agent" in out and "TTFT p99" in out and "goodput tokens" in out
    docs = [results.load(runs / "a"), results.load(runs / "b")]
    table = compare.compare(docs)
    ttft = dict(table["all"])["TTFT p99"]
    assert ttft[1].diff == pytest.approx(ttft[1].value - ttft[0].value)
    other = json.loads((runs / "b" / "results.json").read_text())
    other["run"]["seed"] = 1
    (runs / "c").mkdir()
    (runs / "c" / "results.json").write_text(json.dumps(other))
    assert main(["compare", str(runs / "a"), str(runs / "c")]) == 2
    assert "different seeds" in capsys.readouterr().err
    assert main(["compare", str(runs / "a"), str(runs / "c"), "--force"]) == 0


def test_closed_loop_and_trace_replay(server, tmp_path):
    from twospeed.lab.bench import BenchConfig, run_bench

    common = dict(url=server.url, model="demo", seed=0, tokenizer="demo", max_output_tokens=6, ignore_eos=True,
                  progress=False)
    doc = run_bench(BenchConfig(workload="chat", requests=4, concurrency=2, **common))
    assert doc["total"]["requests"] == 4 and doc["total"]["errors"] == 0
    assert all(r["intended_s"] is None and r["lag_s"] is None for r in doc["requests"])
    assert doc["run"]["mode"]["concurrency"] == 2
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": t, "prompt": f"hello {i}", "max_tokens": 4, "lane": lane}) + "\n"
                             for i, (t, lane) in enumerate([(0.0, "x"), (0.2, "y"), (0.4, "x")])))
    doc = run_bench(BenchConfig(workload=str(trace), requests=3, out=str(tmp_path / "out"), **common))
    results.validate(doc)
    assert [r["intended_s"] for r in doc["requests"]] == [0.0, 0.2, 0.4]
    assert all(r["sent_s"] >= r["intended_s"] for r in doc["requests"])
    assert doc["lanes"]["x"]["requests"] == 2 and doc["lanes"]["y"]["requests"] == 1
