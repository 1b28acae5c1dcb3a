"""The planner: roofline FLOP and byte counts against a brute-force count on the real model, the toy clock's
properties, the hardware probe, and `twospeed clock`."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from conftest import float32_llm, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.cli import main
from twospeed.engine.runner import kv_bytes_per_block
from twospeed.model.attention import causal_mask
from twospeed.model.loader import load_model_config
from twospeed.plan import roofline as rl
from twospeed.plan.clock import ToyClock, parse_case
from twospeed.plan.hardware import PROFILES, LocalMeasurement, get_profile, measure_local

CLOCK_PY = Path(__file__).resolve().parents[2] / "twospeed" / "plan" / "clock.py"


# -- brute-force FLOP count over the engine's real forward pass --------------------------------------
def _sdpa_cpu_flops(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None,
                    out_val=None, **_):
    """FLOPs of the (query, key) pairs the kernel is told to attend: counted from the mask it gets.

    torch's FlopCounterMode has no entry for the CPU flash kernel; this one counts only unmasked pairs,
    so it checks the roofline's causal (and windowed) pair count, not a dense upper bound."""
    b, h, sq, d = query.shape
    sk = key.shape[2]
    if attn_mask is not None:
        # SDPA hands the kernel a bool mask converted to an additive one: 0 = attend, -inf = masked
        keep = attn_mask if attn_mask.dtype == torch.bool else torch.isfinite(attn_mask)
        allowed = int(torch.broadcast_to(keep, (b, h, sq, sk)).sum())
    else:
        assert is_causal and sq == sk, "the engine calls SDPA unmasked only for a causal chunk from position 0"
        allowed = b * h * sq * (sq + 1) // 2
    return 4 * d * allowed  # QK^T and PV: one multiply-add each per pair and head dim


_sdpa_cpu_flops._get_raw = True  # give it the tensors (the mask), not only shapes
COUNTERS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops}


def _counted(llm: LLM, prompts, max_tokens: int):
    with FlopCounterMode(display=False, custom_mapping=COUNTERS) as counter:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert set(counts) <= {"aten.mm", "aten.addmm", "aten._scaled_dot_product_flash_attention_for_cpu"}, counts
    return counter.get_total_flops(), outs


def _expected(cfg, prompt_len: int, cached: int, outputs: int) -> int:
    """One request: prefill of the uncached part after the cached prefix, then outputs - 1 decode steps."""
    total = rl.prefill_flops(cfg, prompt_len - cached, cached).total
    return total + sum(rl.decode_step_flops(cfg, [prompt_len + k - 1]).total for k in range(1, outputs))


CASES = ["llama", "mistral", "qwen2", "qwen3", "mistral-window"]


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory):
    arch, _, variant = request.param.partition("-")
    path = tmp_path_factory.mktemp(request.param)
    write_hf_checkpoint(path, arch, **({"sliding_window": 8} if variant == "window" else {}))
    return request.param, path


def test_flops_match_a_count_of_the_real_forward(checkpoint):
    """FlopCounterMode over the engine's forward (chunked prefill, a prefix-cache hit, a mixed decode batch)
    equals the roofline's prefill and decode FLOPs summed over the requests."""
    name, path = checkpoint
    # the portable attention path: the CPU decode kernel is a C call that FlopCounterMode cannot see
    llm = float32_llm(path, block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24, attention_backend="torch")
    cfg = llm.engine.model_config
    assert (cfg.sliding_window == 8) == name.endswith("window")
    base = [(7 * i) % 200 + 3 for i in range(37)]
    total, outs = _counted(llm, [base], 1)  # 37 tokens in chunks of 24 + 13: logits only on the last
    assert outs[0].bill.cached_tokens == 0
    assert total == _expected(cfg, 37, 0, 1)
    # A prefix-cache hit (20 tokens = 5 blocks) and two fresh prompts decoding together, different lengths.
    prompts = [base[:20] + [5] * 13, [9] * 11, [11, 12, 13]]
    total, outs = _counted(llm, prompts, 4)
    assert [o.bill.cached_tokens for o in outs] == [20, 0, 0]
    assert total == sum(_expected(cfg, len(p), o.bill.cached_tokens, 4) for p, o in zip(prompts, outs))


def test_attention_pairs_match_the_engines_causal_mask():
    for window in (None, 1, 3, 8, 50):
        for n in (1, 2, 5, 17):
            for c in (0, 1, 4, 9, 40):
                mask = causal_mask(n, c + n, window, torch.device("cpu"))
                brute = n * (n + 1) // 2 if mask is None else int(mask.sum())
                assert rl.attention_pairs(n, c, window) == brute, (window, n, c)


def test_chunks_add_up_to_the_whole_prefill():
    cfg = load_model_config_for("qwen3")
    for n1, n2, c in ((1, 1, 0), (7, 9, 0), (16, 3, 5), (100, 1, 31)):
        whole = rl.prefill_flops(cfg, n1 + n2, c)
        first, second = rl.prefill_flops(cfg, n1, c, sampled_rows=0), rl.prefill_flops(cfg, n2, c + n1)
        assert first.total + second.total == whole.total
    # a decode step is a one-token prefill chunk that samples
    assert rl.decode_step_flops(cfg, [12, 30]).total == rl.prefill_flops(cfg, 1, 12).total + rl.prefill_flops(cfg, 1, 30).total


def load_model_config_for(arch: str):
    with tempfile.TemporaryDirectory() as d:
        write_hf_checkpoint(d, arch)
        return load_model_config(d)


# -- bytes ---------------------------------------------------------------------------------------------
def test_param_and_kv_bytes_match_the_checkpoint(checkpoint):
    """Parameter counts from the tensors in the checkpoint's safetensors file (a tied head is not stored)."""
    _, path = checkpoint
    cfg = load_model_config(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    assert rl.param_count(cfg) == sum(math.prod(s) for s in shapes.values())
    for dtype in (torch.float32, torch.bfloat16):
        nbytes = rl.dtype_bytes(dtype)
        assert rl.param_bytes(cfg, nbytes) == nbytes * sum(math.prod(s) for s in shapes.values())
        assert rl.kv_bytes_per_token(cfg, nbytes) * 16 == kv_bytes_per_block(cfg, 16, dtype)
        # A decode step reads each weight once; an untied embedding table only in the rows it looks up.
        for batch in (1, 3):
            brute = nbytes * sum(math.prod(s) if name != "model.embed_tokens.weight" or cfg.tie_word_embeddings
                                 else batch * s[1] for name, s in shapes.items())
            assert rl.decode_weight_bytes(cfg, batch, nbytes) == brute


def test_decode_step_bytes():
    cfg = load_model_config_for("llama")
    per_token = rl.kv_bytes_per_token(cfg, 2)
    step = rl.decode_step_bytes(cfg, [10, 0, 99], 2)
    assert step.kv_read == (11 + 1 + 100) * per_token and step.kv_write == 3 * per_token
    assert step.total == step.weights + step.kv_read + step.kv_write
    windowed = rl.decode_step_bytes(dataclasses.replace(cfg, sliding_window=8), [10, 3], 2)
    assert windowed.kv_read == (8 + 4) * per_token
    assert rl.decode_step_bytes(cfg, [5], 2, kv_cache_dtype="fp8").kv_read == 6 * per_token // 2
    int8 = rl.decode_step_bytes(cfg, [5], 2, kv_cache_dtype="int8").kv_read  # a bf16 scale per token and KV head
    assert int8 == 6 * 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 2)
    with pytest.raises(ValueError):
        rl.decode_step_bytes(cfg, [], 2)


def test_roofline_case_sums_the_steps():
    cfg = rl.load_config("demo")
    hw = PROFILES["h100-sxm"]
    case = rl.roofline_case(cfg, hw.flops_for("bfloat16"), hw.memory_bandwidth, 1000, 5, batch=2)
    steps = [rl.decode_step_bytes(cfg, [1000 + k - 1] * 2, 2).total for k in range(1, 5)]
    assert case.decode_steps == 4 and case.decode_bytes == sum(steps)
    assert case.decode_bytes_first == steps[0] < case.decode_bytes_last == steps[-1]
    assert math.isclose(case.prefill_s, rl.prefill_flops(cfg, 1000).total / 989.4e12)
    assert math.isclose(case.itl_s * 4, case.decode_s)
    assert case.kv_bytes == 2 * 1004 * case.kv_bytes_per_token
    one = rl.roofline_case(cfg, 1e12, 1e11, 1, 1)
    assert one.decode_steps == 0 and one.decode_s == 0 and one.itl_s == 0


# -- the toy clock -------------------------------------------------------------------------------------
def test_toy_clock_scaling():
    clock = ToyClock()
    # prefill: quadratic term alone scales 4x per doubling, linear term alone 2x
    assert math.isclose(ToyClock(b=0).prefill_time(2000), 4 * ToyClock(b=0).prefill_time(1000))
    assert math.isclose(ToyClock(a=0).prefill_time(2000), 2 * ToyClock(a=0).prefill_time(1000))
    # decode: the closed form equals the sum of its steps; steps grow with the cache
    for n, m in ((1, 1), (1, 2), (100, 50), (3000, 7)):
        brute = sum(clock.step_time(n + k) for k in range(1, m))
        assert math.isclose(clock.decode_time(n, m), brute, rel_tol=1e-12, abs_tol=1e-15)
    # monotone in both lengths; the prompt drives prefill, the output drives decode
    lengths = [1, 10, 100, 1000, 10000]
    for x, y in zip(lengths, lengths[1:]):
        assert clock.case(y, 100).prefill_s > clock.case(x, 100).prefill_s
        assert clock.case(y, 100).decode_s > clock.case(x, 100).decode_s  # more cache read per step
        assert clock.case(100, y).decode_s > clock.case(100, x).decode_s
        assert clock.case(100, y).prefill_s == clock.case(100, x).prefill_s
    case = clock.case(8000, 50)
    assert case.itl_last_s > case.itl_mean_s > clock.step
    assert math.isclose(case.total_s, case.prefill_s + case.decode_s)
    assert clock.case(5, 1).decode_s == 0 and clock.case(5, 1).decode_share == 0
    with pytest.raises(ValueError):
        clock.case(0, 5)
    with pytest.raises(ValueError):
        ToyClock(a=-1)


def test_parse_case():
    assert parse_case("8000:50") == (8000, 50) and parse_case("10x2") == (10, 2)
    for bad in ("8000", "a:b", "0:5", "5:-1", "1:2:3"):
        with pytest.raises(ValueError):
            parse_case(bad)


def test_toy_clock_runs_on_the_standard_library_alone():
    """clock.py run as a script with torch and numpy made unimportable."""
    code = ("import sys, runpy; sys.modules.update(torch=None, numpy=None); "
            f"sys.argv = ['clock', '100:10', '2000:3', '--json']; runpy.run_path({str(CLOCK_PY)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [(c["prompt_tokens"], c["output_tokens"]) for c in data["cases"]] == [(100, 10), (2000, 3)]
    assert data["cases"][0]["prefill_s"] == pytest.approx(ToyClock().prefill_time(100))


# -- hardware ------------------------------------------------------------------------------------------
def test_profiles_and_probe():
    for p in PROFILES.values():
        assert p.flops_for("bfloat16") >= p.flops_for("float32") > 0 and p.memory_bandwidth > 0
    assert PROFILES["h100-sxm"].flops_for("float16") == PROFILES["h100-sxm"].flops_for("bfloat16")
    with pytest.raises(ValueError, match="unknown hardware"):
        get_profile("tpu-v9")
    m = measure_local("cpu", seconds=0.3)
    assert isinstance(m, LocalMeasurement) and m.device == "cpu"
    assert set(m.matmul_flops) == {"bfloat16", "float32"} and min(m.matmul_flops.values()) > 1e8
    assert m.copy_bandwidth > 1e8
    assert m.to_profile().flops_for("float32") == m.matmul_flops["float32"]


# -- CLI -----------------------------------------------------------------------------------------------
def test_clock_cli(capsys):
    assert main(["clock", "100:10", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "toy" and data["cases"][0]["decode_s"] == pytest.approx(ToyClock().decode_time(100, 10))
    assert main(["clock"]) == 0
    assert "prefill" in capsys.readouterr().out

    assert main(["clock", "--model", "demo", "--hardware", "a100-80gb", "4000:20", "--batch", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = rl.roofline_case(rl.load_config("demo"), 312e12, 2039e9, 4000, 20, 4, 2)
    assert data["dtype"] == "bfloat16" and data["cases"][0] == expected.to_dict()
    assert main(["clock", "--model", "demo", "--hardware", "l4"]) == 0
    assert "KV 8,192 bytes/token" in capsys.readouterr().out  # demo: 2 x 8 layers x 4 kv heads x 64 x 2 bytes
    assert main(["clock", "--list-hardware"]) == 0
    assert "h100-sxm" in capsys.readouterr().out

    for argv, message in ((["clock", "5"], "PROMPT:OUTPUT"),
                          (["clock", "--model", "demo"], "both --model and --hardware"),
                          (["clock", "--model", "demo", "--hardware", "abacus"], "unknown hardware"),
                          (["clock", "--model", "/nonexistent", "--hardware", "l4"], "not 'demo'"),
                          (["clock", "--model", "demo", "--hardware", "l4", "--dtype", "fp7"], "unknown dtype"),
                          (["clock", "--model", "demo", "--hardware", "l4", "--batch", "0"], "--batch")):
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err
