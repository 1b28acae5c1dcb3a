"""The planner's answers: the roofline step cost by hand for two GPUs, the rate search's boundary, and the commands.

- RooflineCost on a Llama-3-8B-shaped config: a decode step on an H100 SXM (bandwidth-bound) and a 2048-token
  prefill on an L40S (compute-bound), each against the arithmetic written out, and the formats' bytes.
- `twospeed plan` on a GPU profile: the rate it reports meets every lane's goal when simulated again, the next
  rate it tried above does not, and the two are within the tolerance.
- `twospeed simulate`: results.json as the lab writes it (validated against its schema), `twospeed compare`
  accepts two simulated runs; an agent-jobs run's later turns hit the cache the earlier ones filled.
- `twospeed plan calibrate` on the demo model (a tiny sweep), and `simulate --profile` with what it wrote.
"""

from __future__ import annotations

import argparse
import json

import pytest

from twospeed.cli import main
from twospeed.config import ModelConfig
from twospeed.engine.cost_model import StepShape
from twospeed.lab import results
from twospeed.plan.hardware import PROFILES
from twospeed.plan.precision import kv_bytes_per_token, weight_bytes
from twospeed.plan.step_cost import Efficiency, RooflineCost

LLAMA3_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)


def llama3_8b() -> ModelConfig:
    return ModelConfig(**LLAMA3_8B)


def test_roofline_step_times_by_hand():
    cfg, eff = llama3_8b(), Efficiency(compute=0.5, bandwidth=0.8, step_overhead_s=0.002)
    # linears per layer: 4096 x (4096 + 2 x 1024) + 4096 x 4096 + 3 x 4096 x 14336 = 218,103,808; x 32 layers
    linear = 32 * 218_103_808
    params = linear + 2 * 128256 * 4096 + 32 * 2 * 4096 + 4096  # + untied embedding and head, norms
    assert params == 8_030_261_248
    assert weight_bytes(cfg, "bfloat16") == 2 * params
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert kv_bytes_per_token(cfg, "bfloat16") == per_token == 131_072

    # H100 SXM, one decode row after 1000 cached tokens: it attends 1001 positions and samples once
    h100 = RooflineCost(cfg, PROFILES["h100-sxm"], "bfloat16", efficiency=eff)
    decode = StepShape().with_chunk(1000, 1, True, True)
    flops = 2 * linear + 4 * 32 * 32 * 128 * 1001 + 2 * 4096 * 128256
    nbytes = 2 * params + per_token * (1001 + 1)  # every weight, the KV attended, one new K and V
    assert h100.flops(decode) == flops == 15_534_129_152
    assert h100.bytes(decode) == nbytes == 16_191_856_640
    assert h100.predict(decode) == pytest.approx(0.002 + nbytes / (3.35e12 * 0.8))  # 8.04 ms: bandwidth-bound
    assert h100.bound(decode) == "bandwidth"

    # L40S, a 2048-token prompt from position 0 (2048 x 2049 / 2 pairs), sampled
    l40s = RooflineCost(cfg, PROFILES["l40s"], "bfloat16", efficiency=eff)
    prefill = StepShape().with_chunk(0, 2048, False, True)
    pairs = 2048 * 2049 // 2
    flops = 2 * linear * 2048 + 4 * 32 * 32 * 128 * pairs + 2 * 4096 * 128256
    assert l40s.flops(prefill) == flops == 29_688_401_494_016
    assert l40s.bytes(prefill) == pytest.approx(2 * params + per_token * (pairs / 128 + 2048))
    assert l40s.predict(prefill) == pytest.approx(0.002 + flops / (362.05e12 * 0.5))  # 166 ms: compute-bound
    assert l40s.bound(prefill) == "compute"

    # int8 weights: one byte a linear weight plus a float32 scale per output row; the rest stays bf16
    rows = 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    head = 128256 * 4096  # the output head is quantized too (as the engine does); the embedding stays bf16
    assert weight_bytes(cfg, "bfloat16", "int8") == linear + 4 * rows + head + 4 * 128256 + 2 * (params - linear - head)
    assert kv_bytes_per_token(cfg, "bfloat16", "int8") == 2 * 32 * 8 * (128 + 2)  # a bf16 scale per token and head
    w8 = RooflineCost(cfg, PROFILES["h100-sxm"], "bfloat16", "int8", "fp8", eff)
    w8_bytes = linear + 4 * rows + head + 4 * 128256 + 2 * (params - linear - head) + (per_token // 2) * 1002  # fp8 KV: one byte an element
    assert w8.predict(decode) == pytest.approx(0.002 + w8_bytes / (3.35e12 * 0.8))  # the same FLOPs, half the bytes


def _config_dir(tmp_path, **overrides):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "max_position_embeddings": 8192, "torch_dtype": "bfloat16", **overrides}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def _plan_namespace(argv: list[str]) -> argparse.Namespace:
    from twospeed.plan.sim_commands import add_plan_args

    parser = argparse.ArgumentParser(conflict_handler="resolve")
    add_plan_args(parser)
    return parser.parse_args(argv)


def test_plan_rate_meets_and_the_next_step_up_does_not(tmp_path, capsys):
    from twospeed.plan.capacity import point
    from twospeed.plan.simulate import run
    from twospeed.plan.sim_commands import question

    model = str(_config_dir(tmp_path))
    argv = ["--workload", "chat", "--hardware", "h100-sxm", "--model", model, "--requests", "64",
            "--max-num-seqs", "16", "--max-output-tokens", "100", "--slo", "chat:ttft_p99=400ms,itl_p99=60ms",
            "--quick", "--tolerance", "0.15", "--start-rate", "4", "--target-rate", "30"]
    assert main(["plan", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    best, above = report["per_replica"]["best"], report["per_replica"]["above"]
    assert best["met"] and not above["met"] and best["rate"] < above["rate"] <= best["rate"] * 1.15 + 1e-9
    binding = above["binding"]
    assert binding["lane"] == "chat" and binding["cause"] and binding["speed"]
    # simulated again from the same flags: the same verdicts
    q = question(_plan_namespace(argv))
    assert point(run(q.scenario, q.deployment, best["rate"]), q.goals).verdict.met
    assert not point(run(q.scenario, q.deployment, above["rate"]), q.goals).verdict.met
    replicas = report["replicas"]
    assert replicas["replicas"] >= 30 / best["rate"] and replicas["checks"][-1]["met"]
    pool = report["kv"]["pool"]
    assert pool["kv_bytes_per_token"] == 131_072 and pool["weight_bytes"] == 2 * 8_030_261_248
    assert main(["plan", *argv]) == 0
    assert "max sustainable rate per replica" in capsys.readouterr().out


def test_simulate_writes_results_the_lab_reads(tmp_path, capsys):
    common = ["--workload", "mixed", "--hardware", "h100-sxm", "--model", "demo", "--requests", "16", "--rate", "6",
              "--scale", "0.1", "--max-prompt-tokens", "1500", "--no-report"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["simulate", *common, "--out", str(a)]) == 0
    assert main(["simulate", *common, "--out", str(b), "--target-step-ms", "0", "--label", "steps by tokens"]) == 0
    doc = results.load(a)  # validated against results.schema.json
    assert doc["run"]["simulated"]["cost_model"] == "roofline" and doc["run"]["server_kind"] == "twospeed"
    assert doc["total"]["requests"] == 16 and doc["total"]["errors"] == 0
    assert all(r["output_tokens"] == r["max_tokens"] for r in doc["requests"])  # EOS-free
    assert doc["lanes"]["agent"]["bill"]["cached_tokens"] > 0  # its shared prefix hits, as live
    for r in doc["requests"]:
        assert r["server_ttft_s"] == pytest.approx(r["ttft_s"], abs=1e-6)
        assert r["prompt_tokens"] == r["cached_tokens"] + r["prefilled_tokens"]
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 0
    assert "TTFT p99" in capsys.readouterr().out


def test_simulated_agent_jobs_hit_the_cache_turn_by_turn(tmp_path):
    out = tmp_path / "jobs"
    assert main(["simulate", "--workload", "agent-jobs", "--hardware", "h100-sxm", "--model", "demo", "--requests", "3",
                 "--rate", "1", "--scale", "0.1", "--max-prompt-tokens", "3000", "--no-report", "--out", str(out)]) == 0
    doc = results.load(out)
    assert len(doc["jobs"]) == 3 and all(j["error"] is None for j in doc["jobs"])
    for job in doc["jobs"]:
        calls = sorted((r for r in doc["requests"] if r["job"] == job["index"]), key=lambda r: r["turn"])
        assert len(calls) >= 2
        for prev, cur in zip(calls, calls[1:]):
            assert cur["sent_s"] >= prev["sent_s"] + prev["ttlt_s"] - 1e-9  # one after another
        assert all(c["cached_tokens"] > 0 for c in calls[1:])  # each turn hits what the turns before filled
        assert calls[-1]["cached_tokens"] > calls[1]["cached_tokens"]


def test_calibrate_then_simulate_with_the_profile(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    assert main(["plan", "calibrate", "--model", "demo", "--out", str(profile), "--num-gpu-blocks", "96",
                 "--chunks", "16,48", "--contexts", "0,32", "--batches", "1,3", "--decode-steps", "3",
                 "--repeats", "1", "--no-mixed"]) == 0
    assert "relative error" in capsys.readouterr().out
    doc = json.loads(profile.read_text())
    assert doc["kind"] == "twospeed-step-profile" and doc["engine"]["num_blocks"] == 96
    assert doc["residuals"]["all"]["n"] >= 6 and all(c >= 0 for c in doc["coefficients"])
    out = tmp_path / "sim"
    assert main(["simulate", "--workload", "chat", "--profile", str(profile), "--model", "demo", "--requests", "6",
                 "--rate", "2", "--scale", "0.2", "--no-report", "--out", str(out)]) == 0
    sim = results.load(out)
    assert sim["run"]["simulated"]["cost_model"] == "calibrated" and sim["total"]["errors"] == 0


def test_plan_tunes_formats_and_pools(tmp_path, capsys):
    """The other answers on a small scenario: every tuning row, a format row per format (int8 KV holds more tokens,
    int8 weights weigh less), colocated against each prefill + decode split."""
    model = str(_config_dir(tmp_path))
    argv = ["plan", "--workload", "chat", "--hardware", "h100-sxm", "--model", model, "--requests", "32",
            "--max-num-seqs", "8", "--max-output-tokens", "40", "--tolerance", "0.3", "--start-rate", "8",
            "--tune-step-ms", "0,50", "--tune-budgets", "256", "--formats", "none/auto,int8/int8",
            "--pool-gpus", "2", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    tuning = report["tuning"]
    assert {(r["target_step_ms"], r["max_num_batched_tokens"]) for r in tuning["rows"]} >= {(50.0, 2048), (0.0, 2048)}
    assert any(r["max_num_batched_tokens"] == 256 for r in tuning["rows"])
    assert tuning["best"]["max_rate"] == max(r["max_rate"] for r in tuning["rows"])
    plain, w8 = report["formats"]
    assert w8["kv_capacity_tokens"] > 1.9 * plain["kv_capacity_tokens"] and w8["weight_bytes"] < plain["weight_bytes"]
    (pool,) = report["pools"]
    layouts = [(r["prefill"], r["decode"]) for r in pool["rows"]]
    assert layouts == [(None, None), (1, 1)] and all(r["per_gpu"] == r["max_rate"] / 2 for r in pool["rows"])
