"""Agent jobs end to end: `twospeed serve` on the demo model, the built-in `agent-jobs` workload through
`twospeed bench` with tool dumps kept whole and summarized. Each job's cached tokens grow turn by turn (the
history is append-only behind a byte-stable prefix), each job's split sums to its wall time with the queue
and prefill from the server's own clock, summarize-on prefills fewer tokens per turn than summarize-off in
`twospeed compare`, the files hold every call with its job and turn, and `twospeed diagnose` reprints the
diagnosis. Also: a lane asking for 240 prompt tokens bills exactly 240 on twospeed (completions and chat)."""

import csv
import json

import pytest

from twospeed.cli import main
from twospeed.lab import compare, results
from twospeed.lab.local_server import LocalServer

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP

OTHER_TOLERANCE_S = 0.5  # time in a job the lab could not attribute (prompt building), on a shared machine


@pytest.fixture(scope="module")
def server():
    from twospeed.builtin.demo import demo_checkpoint_path

    demo_checkpoint_path()
    with LocalServer("demo", ["--kv-cache-memory-gb", "0.1", "--max-num-batched-tokens", "512"]) as s:
        yield s


def _bench(server, out, label, *extra, workload="agent-jobs", requests="2"):
    return main(["bench", "--url", server.url, "--model", "demo", "--workload", workload, "--requests", requests,
                 "--rate", "4", "--seed", "0", "--scale", "0.1", "--max-prompt-tokens", "3000",
                 "--max-output-tokens", "12", "--ignore-eos", "--tokenizer", "demo", "--salt", label, "--label", label,
                 "--out", str(out), "--no-progress", *extra])


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    assert _bench(server, root / "off", "off") == 0
    assert _bench(server, root / "on", "on", "--summarize-dumps", "64") == 0
    return root


def _doc(runs, name):
    return json.loads((runs / name / "results.json").read_text())


def test_cached_tokens_grow_turn_by_turn(runs):
    doc = _doc(runs, "off")
    results.validate(doc)
    assert len(doc["jobs"]) == 2 and all(j["error"] is None for j in doc["jobs"])
    for j in doc["jobs"]:
        cached = [t["cached_tokens"] for t in j["turns"]]
        prompt = [t["prompt_tokens"] for t in j["turns"]]
        assert len(cached) >= 3 and cached == sorted(cached) and len(set(cached)) == len(cached), cached
        assert prompt == sorted(prompt) and all(c < p for c, p in zip(cached, prompt))
        assert all(c >= p0 - 16 for c, p0 in zip(cached[1:], prompt))  # all of the previous prompt but its last block
    turns = doc["lanes"]["support-job"]["jobs"]["turns"]
    assert [t["turn"] for t in turns][:3] == [1, 2, 3] and turns[1]["observation_tokens"] > 300  # the gather dumps


def test_job_split_sums_to_the_wall_time(runs):
    doc = _doc(runs, "off")
    calls = {}
    for r in doc["requests"]:
        calls.setdefault(r["job"], []).append(r)
    for j in doc["jobs"]:
        parts = [j[f"{p}_s"] for p in ("queue", "prefill", "decode", "tool", "gate", "other")]
        assert sum(parts) == pytest.approx(j["wall_s"], abs=1e-6)
        assert -1e-3 <= j["other_s"] <= max(OTHER_TOLERANCE_S, 0.1 * j["wall_s"])
        assert j["clock_source"] == "twospeed" and j["prefill_s"] > 0 and j["decode_s"] > 0 and j["tool_s"] > 0
        mine = calls[j["index"]]
        assert j["queue_s"] == pytest.approx(sum(r["server_queue_s"] for r in mine), abs=1e-6)
        assert j["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine) and j["calls"] == len(mine)
        for a, b in zip(mine, mine[1:]):  # one after another, each after the previous answer
            assert b["turn"] == a["turn"] + 1 and b["sent_s"] >= a["sent_s"] + a["call_s"]
    with open(runs / "off" / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(doc["requests"]) and all(r["job"] != "" and r["turn"] != "" for r in rows)
    with open(runs / "off" / "jobs.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    for name in ("report.html", "job_split.png", "job_turns_support-job.png"):
        assert (runs / "off" / name).stat().st_size > 0


def test_summarize_on_prefills_less_per_turn(runs, capsys):
    docs = [results.load(runs / "off"), results.load(runs / "on")]
    assert docs[1]["lanes"]["support-job"]["policy"]["summarize"] == {"max_tokens": 64, "by": "truncate"}
    rows = dict(compare.compare(docs)["support-job"])
    assert rows["prefilled tokens/turn"][1].diff < 0 and rows["prompt tokens/turn"][1].diff < 0
    off, on = (d["lanes"]["support-job"]["jobs"]["turns"][1] for d in docs)
    assert on["observation_tokens"] < off["observation_tokens"] and on["prefilled_tokens"] < off["prefilled_tokens"]
    assert main(["compare", str(runs / "off"), str(runs / "on")]) == 0
    out = capsys.readouterr().out
    assert "per turn" in out and "prefill per turn p50" in out and "summarized to 64 tokens" in out


def test_diagnose_reprints_the_diagnosis(runs, capsys):
    doc = _doc(runs, "off")
    assert [d["lane"] for d in doc["diagnosis"]] == ["support-job"] and doc["diagnosis"][0]["unit"] == "jobs"
    assert main(["diagnose", str(runs / "off"), str(runs / "on")]) == 0
    out = capsys.readouterr().out
    assert "diagnosis of off" in out and "diagnosis of on" in out and "support-job (jobs):" in out
    assert main(["diagnose", str(runs / "off"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)[str(runs / "off")]
    assert [d["verdict"] for d in again] == [d["verdict"] for d in doc["diagnosis"]]


def test_prompt_tokens_are_billed_exactly(server, tmp_path):
    workload = tmp_path / "exact.yaml"
    workload.write_text("lanes:\n"
                        "  - {name: plain, kind: chat, prompt_tokens: 240, max_tokens: 2}\n"
                        "  - {name: wrapped, kind: chat, endpoint: chat, prompt_tokens: 240, max_tokens: 2}\n")
    from twospeed.lab.bench import BenchConfig, run_bench

    doc = run_bench(BenchConfig(url=server.url, model="demo", workload=str(workload), requests=4, rate=8.0,
                                tokenizer="demo", progress=False))  # a fresh random salt, inside the count
    assert {r["lane"] for r in doc["requests"]} == {"plain", "wrapped"}
    assert [r["prompt_tokens"] for r in doc["requests"]] == [240] * 4  # the server's own bill
    assert doc["total"]["throughput"]["requests_per_s"] > 0 and doc["total"]["throughput"]["output_tokens_per_s"] > 0
