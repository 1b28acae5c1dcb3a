"""The quantization gate: its statistics against brute force and exact values, the verdict rules on hand-built
runs, and `twospeed gate` end to end against two `twospeed serve` processes (ship, no-ship with the reason, the
exit codes, a reused baseline, `twospeed compare` on the two runs)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from twospeed.cli import main
from twospeed.lab import gate_verdict, probes
from twospeed.lab.compare import load_runs
from twospeed.lab.gate import GateConfig
from twospeed.model.compute_dtype import auto_kv_cache_dtype
from twospeed.builtin import task_model

pytestmark = pytest.mark.e2e  # drives a whole server over HTTP


@pytest.mark.parametrize("lost,gained", [(0, 0), (1, 0), (3, 1), (5, 0), (4, 4), (2, 7)])
def test_paired_drop_p_value_is_the_exact_binomial_tail(lost, gained):
    base = [True] * lost + [False] * gained + [True] * 3 + [False] * 2  # + agreeing pairs, which do not count
    cand = [False] * lost + [True] * gained + [True] * 3 + [False] * 2
    d = gate_verdict.mcnemar_drop(base, cand)
    assert (d["lost"], d["gained"], d["pairs"]) == (lost, gained, lost + gained + 5)
    n = lost + gained
    brute = sum(sum(o) >= lost for o in itertools.product((0, 1), repeat=n)) / 2 ** n  # every coin-flip outcome
    assert d["p_value"] == pytest.approx(brute if lost else 1.0)
    if (lost, gained) == (5, 0):
        assert d["p_value"] == 1 / 32


def test_token_agreement_and_first_divergence():
    assert gate_verdict.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert gate_verdict.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert gate_verdict.first_divergence([1, 2], [1, 2, 3]) == 2
    a = gate_verdict.token_agreement([([1, 2], [1, 2]), ([1, 2, 3], [1, 2, 4]), ([7], [8])])
    assert a["pairs"] == 3 and a["exact_match"] == pytest.approx(1 / 3)
    assert a["first_divergence_min"] == 0 and a["first_divergence_p50"] == 1.0


def test_kl_on_the_top_k_equals_the_exact_kl_when_the_top_k_is_everything():
    p = {"a": 0.5, "b": 0.3, "c": 0.2}
    q = {"a": 0.4, "b": 0.4, "c": 0.2}
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    lp = {t: math.log(v) for t, v in p.items()}
    lq = {t: math.log(v) for t, v in q.items()}
    assert probes.kl_topk(lp, lq) == pytest.approx(exact)
    assert probes.kl_topk(lp, lp) == pytest.approx(0.0, abs=1e-12)
    # a token the candidate dropped from its top-k costs at least what its k-th token's probability implies
    assert probes.kl_topk(lp, {"a": math.log(0.9), "b": math.log(0.05)}) > probes.kl_topk(lp, lq)
    c = probes.compare([lp, lp, None], [lq, {"b": 0.0}, lp])
    assert c["probes"] == 2 and c["failed"] == 1 and c["top1_agreement"] == 0.5


def summary(rate: float, n: int, ttft: float, ttft_ci, itl: float = 0.02, itl_ci=(0.019, 0.021), errors: int = 0) -> dict:
    stat = {"ttft": {"p50": ttft, "p50_ci": list(ttft_ci), "p99": ttft, "p99_ci": list(ttft_ci)},
            "itl": {"p50": itl, "p50_ci": list(itl_ci), "p99": itl, "p99_ci": list(itl_ci)}}
    return {"requests": n, "errors": errors, "stats": stat, "gate": {"rate": rate}}


def slower(k: int, n: int) -> dict:
    """Every latency metric: k of n paired requests slower beyond the tolerance."""
    p = gate_verdict.paired_slower([1.0] * n, [2.0] * k + [1.0] * (n - k), 0.1)
    return {label: p for label, *_ in gate_verdict.LATENCY}


def test_paired_sign_test():
    p = gate_verdict.paired_slower([1.0, 1.0, 1.0, None], [1.2, 1.05, 2.0, 3.0], 0.1)
    assert (p["pairs"], p["slower"], p["p_value"]) == (3, 2, 0.5)


def test_verdict_rules():
    base, none = summary(1.0, 20, 0.5, (0.45, 0.55)), slower(0, 20)
    drop = gate_verdict.mcnemar_drop([True] * 20, [True] * 12 + [False] * 8)
    j = gate_verdict.judge_lane("agent", base, summary(0.6, 20, 0.5, (0.45, 0.55)), drop, none)
    assert not j.ship and j.reasons[0].startswith("gate pass dropped beyond the noise: 100% -> 60%")
    one = gate_verdict.mcnemar_drop([True] * 20, [True] * 19 + [False])
    j = gate_verdict.judge_lane("agent", base, summary(0.95, 20, 0.52, (0.47, 0.57)), one, none)
    assert j.ship and "within the noise" in j.notes[0]
    slow = gate_verdict.judge_lane("agent", base, summary(1.0, 20, 0.9, (0.85, 0.95)), one, slower(18, 20))
    assert not slow.ship and any(r.startswith("latency got worse: TTFT p50") for r in slow.reasons)
    # each of the three conditions alone is not enough: beyond the tolerance but inside the noise (intervals
    # overlap), or too few pairs slower, or worse beyond the noise but inside the tolerance
    assert gate_verdict.judge_lane("a", base, summary(1.0, 20, 0.7, (0.5, 0.9)), one, slower(20, 20)).ship
    assert gate_verdict.judge_lane("a", base, summary(1.0, 20, 0.9, (0.85, 0.95)), one, slower(13, 20)).ship
    assert gate_verdict.judge_lane("a", base, summary(1.0, 20, 0.54, (0.56, 0.58)), one, slower(20, 20)).ship
    assert gate_verdict.judge_lane("a", base, summary(1.0, 4, 0.9, (0.85, 0.95)), one, slower(4, 4)).ship  # 4 pairs
    assert gate_verdict.judge_lane("a", base, summary(1.0, 20, 0.2, (0.15, 0.25)), one, none).ship  # faster
    failing = gate_verdict.judge_lane("a", base, summary(1.0, 20, 0.5, (0.45, 0.55), errors=3), one, none)
    assert not failing.ship and "3 requests failed" in failing.reasons[0]


def test_a_lane_whose_next_tokens_moved_is_no_ship_whatever_its_gate_says():
    """A grammar-shaped lane passes its gate on any weights: the probes' KL is what catches a broken model."""
    base, none = summary(1.0, 20, 0.5, (0.45, 0.55)), slower(0, 20)
    same = gate_verdict.mcnemar_drop([True] * 20, [True] * 20)
    probe = probes.compare([{"a": -0.1, "b": -2.5}] * 6, [{"b": -0.05, "a": -3.0}] * 6)
    assert probe["kl_mean"] > 1 and probe["top1_agreement"] == 0
    moved = gate_verdict.judge_lane("agent", base, summary(1.0, 20, 0.5, (0.45, 0.55)), same, none, probe=probe)
    assert not moved.ship and moved.reasons[0].startswith("next-token distributions moved: probe KL mean")
    held = probes.compare([{"a": -0.1, "b": -2.5}] * 6, [{"a": -0.12, "b": -2.3}] * 6)
    assert held["kl_mean"] < 0.05
    kept = gate_verdict.judge_lane("agent", base, summary(1.0, 20, 0.5, (0.45, 0.55)), same, none, probe=held)
    assert kept.ship and any(n.startswith("next-token distributions held") for n in kept.notes)
    assert not gate_verdict.judge_lane("agent", base, summary(1.0, 20, 0.5, (0.45, 0.55)), same, none, probe=held,
                                       max_probe_kl=held["kl_mean"] / 2).ship


def test_kv_capacity_from_the_servers_memory():
    memory = {"num_blocks": 100, "block_size": 16, "kv_bytes_per_token": 66, "kv_cache_dtype": "int8"}
    c = gate_verdict.kv_capacity(memory, 250.0)
    assert c["max_tokens"] == 1600 and c["max_sequences"] == 100 // 16
    assert gate_verdict.kv_capacity(None, 250.0) is None


def test_gate_flags_are_checked():
    with pytest.raises(ValueError, match="--model"):
        GateConfig("", "--model other")
    assert GateConfig("--dtype bfloat16", "--quantization 'int8'").candidate_flags == ["--quantization", "int8"]
    assert main(["gate", "--candidate=--port 9", "--out", "/nonexistent/x"]) == 2


# -- end to end against twospeed serve on the demo model ----------------------------------------------------
SERVE = "--kv-cache-memory-gb 0.05"
# about 6 requests a lane (the sign test needs 5 pairs to call a latency worse), at half the rate this suite once
# used: a CI machine running ~5x slower than usual queued the baseline to a 3.8 s TTFT at 8/s, and a queue on both
# sides squeezed the slow candidate's ratio to 2.4x. The slow candidate prefills 4 tokens a step, below this
# traffic's prompt rate, so it queues on any machine (TTFT p50 17-27x the baseline's on an AVX2 VM, p99 7-11x).
# A latency must be over 4x the baseline's to count, since a shared machine's load can double a run's latencies.
RUN = ["--requests", "24", "--rate", "4", "--scale", "0.15", "--probes-per-lane", "1", "--latency-tolerance", "3.0"]


@pytest.fixture(scope="module")
def same_config_gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate") / "same"
    rc = main(["gate", "--baseline", SERVE, "--candidate", SERVE, "--out", str(out), *RUN])
    return rc, out


def test_the_same_configuration_ships(same_config_gate):
    rc, out = same_config_gate
    doc = json.loads((out / "gate.json").read_text())
    reasons = {name: lane["verdict"]["reasons"] for name, lane in doc["lanes"].items()}
    assert rc == 0 and doc["ship"] and doc["exit_code"] == 0, reasons
    assert set(doc["lanes"]) == {"tools", "citations", "codes", "refusals"}
    for lane in doc["lanes"].values():
        assert lane["verdict"]["ship"]
        # greedy on the same model, but batches (and so bf16 roundings) differ with timing, and the random
        # demo model's logits are near ties: most tokens agree, distributions almost exactly
        assert lane["agreement"]["exact_match"] >= 0.5 and lane["agreement"]["pairs"] >= 3
        assert lane["probes"]["top1_agreement"] >= 0.5 and lane["probes"]["kl_max"] < 0.01
        assert lane["kv_capacity"]["baseline"]["max_tokens"] == lane["kv_capacity"]["candidate"]["max_tokens"]
    assert (out / "gate.html").is_file() and (out / "baseline" / "report.html").is_file()
    run = json.loads((out / "baseline" / "results.json").read_text())
    memory = run["server"]["memory"]  # the server's own formats, from /v1/models
    # auto, or bf16 where the bf16 demo computes in float32 (no bf16 kernels) and keeps its cache in bf16
    expected = auto_kv_cache_dtype(torch.bfloat16, torch.float32 if memory["dtype"] == "float32" else torch.bfloat16,
                                   True)
    assert memory["quantization"] is None and memory["kv_cache_dtype"] == expected
    assert run["server"]["kv_memory"]["kv_bytes_per_token"] == memory["kv_bytes_per_token"]  # the bill uses them
    docs = load_runs([str(out / "baseline"), str(out / "candidate")])  # `twospeed compare` takes the two runs
    assert [d["run"]["label"] for d in docs] == ["baseline", "candidate"]


def test_a_slower_candidate_is_no_ship_for_latency(same_config_gate, tmp_path):
    """Against the saved baseline: a candidate that prefills 4 tokens a step (well over 10x the baseline's TTFT, so
    a loaded machine cannot hide it) has far worse TTFT: exit code 1. Judged at a 100% latency tolerance: a lane
    holds 5-7 requests, so one request queued behind others in the baseline (slower there by chance) leaves 6 of 7
    over a 300% tolerance, which a sign test does not call a regression."""
    _, base_out = same_config_gate
    out = tmp_path / "slow"
    judged = [*RUN[:RUN.index("--latency-tolerance")], "--latency-tolerance", "1.0"]
    rc = main(["gate", "--baseline", SERVE, "--candidate", f"{SERVE} --max-num-batched-tokens 4",
               "--baseline-run", str(base_out / "baseline"), "--out", str(out), *judged])
    doc = json.loads((out / "gate.json").read_text())
    assert rc == 1 and not doc["ship"]
    reasons = [r for lane in doc["lanes"].values() for r in lane["verdict"]["reasons"]]
    assert any(r.startswith("latency got worse: TTFT") for r in reasons), reasons
    assert not any(r.startswith("gate pass dropped") for r in reasons)  # the same model: the same contracts kept


def test_a_candidate_that_cannot_start_exits_2(same_config_gate, tmp_path, capsys):
    _, base_out = same_config_gate
    rc = main(["gate", "--candidate", f"{SERVE} --quantization int3", "--baseline-run", str(base_out / "baseline"),
               "--out", str(tmp_path / "bad"), *RUN])
    assert rc == 2 and "int8, fp8" in capsys.readouterr().err  # the server's own message about the flag


def test_a_quantized_server_reports_its_formats():
    """`twospeed serve --quantization int8 --kv-cache-dtype int8`: /v1/models and /metrics say so, in bytes that
    agree with each other, and it answers."""
    import httpx

    from twospeed.lab.local_server import LocalServer

    with LocalServer("demo", ["--quantization", "int8", "--kv-cache-dtype", "int8", "--kv-cache-memory-gb", "0.05"]) as s:
        memory = httpx.get(s.url + "/models").json()["data"][0]["twospeed"]
        metrics = httpx.get(s.url.removesuffix("/v1") + "/metrics").text
        r = httpx.post(s.url + "/completions", json={"model": "demo", "prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert memory["quantization"] == "int8" and memory["kv_cache_dtype"] == "int8"
    assert memory["kv_bytes_per_token"] == 2 * 8 * 4 * (64 + 2)  # the demo: 8 layers, 4 KV heads, head_dim 64
    assert memory["block_bytes"] == memory["block_size"] * memory["kv_bytes_per_token"]
    assert f'twospeed_kv_cache_bytes_per_token{{model="demo"}} {float(memory["kv_bytes_per_token"])}' in metrics
    assert 'twospeed_model_formats{kv_cache_dtype="int8",model="demo",quantization="int8"} 1.0' in metrics


def test_the_report_renders_a_lane_with_nothing_answered(tmp_path):
    from rich.console import Console

    from twospeed.lab import gate_report

    rate = {"passed": 0, "requests": 3, "rate": 0.0, "rate_ci": [0.0, 0.56]}
    lane = {"verdict": {"ship": False, "reasons": ["3 requests failed on the candidate (0 on the baseline)"],
                        "notes": []},
            "gate": {"baseline": rate, "candidate": rate, "paired": gate_verdict.mcnemar_drop([False] * 3, [False] * 3)},
            "latency_s": {label: {"baseline": None, "candidate": None} for label, *_ in gate_verdict.LATENCY},
            "output_tokens_per_s": {"baseline": None, "candidate": None}, "agreement": None, "probes": None,
            "kv_capacity": {"baseline": gate_verdict.kv_capacity({"num_blocks": 4, "block_size": 16,
                                                                   "kv_cache_dtype": "auto"}, None), "candidate": None}}
    doc = {"model": "demo", "workload": "regression", "seed": 0, "ship": False, "exit_code": 1,
           "baseline": {"flags": ""}, "candidate": {"flags": "--quantization int8"}, "lanes": {"tools": lane}}
    console = Console(record=True, width=160)
    gate_report.print_gate(doc, console)
    assert "tools: NO-SHIP: 3 requests failed" in console.export_text()
    gate_report.write_html(doc, tmp_path, str(tmp_path / "baseline"))
    assert "no-ship" in (tmp_path / "gate.html").read_text()


def task_model_or_skip() -> str:
    """The built-in task model (trained in code on the lanes' formats, cached); skip where this tree has none."""
    from twospeed.engine.engine import resolve_model_path

    try:
        resolve_model_path("demo-task")
    except (FileNotFoundError, ValueError) as e:
        pytest.skip(f"no task model here: {e}")
    return "demo-task"


@pytest.mark.task_model
def test_on_the_task_model_int8_ships_and_a_destructive_candidate_is_no_ship(tmp_path):
    """The gate's purpose: int8 weights keep the contracts (ship), a deliberately broken quantization does not
    (no-ship, for the gate pass, not for latency)."""
    model = task_model_or_skip()
    run = ["--model", model, "--workload", "tasks", "--requests", "40", "--probes-per-lane", "2",  # sized for it
           "--latency-tolerance", "3.0"]
    out = tmp_path / "int8"
    rc = main(["gate", "--baseline", SERVE, "--candidate", f"{SERVE} --quantization int8", "--out", str(out), *run])
    doc = json.loads((out / "gate.json").read_text())
    reasons = {name: lane["verdict"]["reasons"] for name, lane in doc["lanes"].items()}
    assert rc == 0 and doc["ship"], reasons
    # a baseline that passes: there the gate can see a regression. Not rag yet: demo-task cites a passage of its
    # prompt ~80% held out, about half at 400-900 tokens (issue 14; test_task_model's NOT_YET)
    weak = {name: lane["gate"]["baseline"]["rate"] for name, lane in doc["lanes"].items()
            if name != "rag" and lane["gate"]["baseline"]["rate"] < 0.8}
    bad = tmp_path / "broken"
    rc = main(["gate", "--candidate", f"{SERVE} --quantization test-random-scale", "--baseline-run",
               str(out / "baseline"), "--out", str(bad), *run])
    doc = json.loads((bad / "gate.json").read_text())
    assert rc == 1 and not doc["ship"]
    caught = [r for lane in doc["lanes"].values() for r in lane["verdict"]["reasons"]]
    assert any(r.startswith("gate pass dropped beyond the noise") for r in caught), caught
    assert doc["probes"]["kl_mean"] > 10 * json.loads((out / "gate.json").read_text())["probes"]["kl_mean"]
    if weak and task_model.bf16_matmuls():  # measured on one build only: a bf16 build's weak lane is reported
        pytest.xfail(f"demo-task trained in bf16 on this CPU: baseline lanes below 0.8 {weak}")
    assert not weak, weak


@pytest.mark.real_model
def test_on_smollm2_its_own_blocks_ship_and_a_destructive_format_is_no_ship(tmp_path):
    """The gate on the built-in real model (SmolLM2-135M-Instruct's Q4_1 GGUF), against the file dequantized: its
    blocks kept packed (int8 activations) keep every lane's contracts and next tokens; a deliberately broken format
    is no-ship in every lane, though the grammar-shaped lanes still pass their gates (the probes catch it)."""
    run = ["--model", "smollm2", "--workload", "tasks", "--requests", "24", "--rate", "0.5", "--probes-per-lane", "2",
           "--latency-tolerance", "3.0"]  # a quality gate here: the formats' speed is BENCHMARKS.md's
    out = tmp_path / "gguf"
    rc = main(["gate", "--baseline", "", "--candidate", "--quantization gguf", "--out", str(out), *run])
    doc = json.loads((out / "gate.json").read_text())
    reasons = {name: lane["verdict"]["reasons"] for name, lane in doc["lanes"].items()}
    assert rc == 0 and doc["ship"], reasons
    assert doc["probes"]["kl_mean"] < 0.05
    bad = tmp_path / "broken"
    rc = main(["gate", "--candidate", "--quantization test-random-scale", "--baseline-run", str(out / "baseline"),
               "--out", str(bad), *run])
    doc = json.loads((bad / "gate.json").read_text())
    assert rc == 1 and not doc["ship"]
    for name, lane in doc["lanes"].items():
        assert any(r.startswith("next-token distributions moved") for r in lane["verdict"]["reasons"]), name
