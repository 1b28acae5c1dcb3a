"""The fused C ops (csrc/fused_bf16.c, csrc/fused_f32.c) against the torch ops they replace: residual add +
RMSNorm, SiLU * up.

Both round where HF's bf16 modules round, so outputs match the torch path exactly except where float32
summation order (the RMS) or the exp polynomial moves a value across a bf16 rounding boundary: at most one
bf16 step, and rarely.
"""

from __future__ import annotations

import pytest
import torch

from conftest import needs_kernel
from twospeed.model.cbuild import unsupported_reason
from twospeed.model.fused_ops import fused_f32_kernel, fused_kernel, rms_norm, silu_mul

bf16_kernel = needs_kernel(fused_kernel, "fused_bf16")


def one_step(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or one bf16 rounding step apart (relative 2^-7 of the larger magnitude), and rarely so."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    ok = bool((diff <= torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 1e-30).all())
    return ok and (diff > 0).float().mean().item() < 0.02


@bf16_kernel
@pytest.mark.parametrize("rows,width", [(1, 768), (3, 40), (8, 36), (33, 1000), (130, 17)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows, width, with_residual):
    g = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(width, generator=g) + 0.5).to(torch.bfloat16)
    res = torch.randn(rows, width, generator=g).to(torch.bfloat16) if with_residual else None
    ref_norm, ref_sum = rms_norm(x, w, 1e-5, None if res is None else res.clone(), use_kernel=False)
    norm, total = rms_norm(x, w, 1e-5, None if res is None else res.clone())
    assert torch.equal(total, ref_sum)  # the residual add is exact bf16 rounding either way
    assert one_step(norm, ref_norm)
    if with_residual:
        # and the test can fail: a wrong weight moves the output by far more than a rounding step
        assert not one_step(rms_norm(x, w * 1.1, 1e-5, res.clone())[0], ref_norm)


@bf16_kernel
def test_rms_norm_reads_a_strided_row_view():
    x = torch.randn(5, 64).to(torch.bfloat16)
    wide = torch.cat([x, torch.zeros(5, 8, dtype=x.dtype)], dim=1)[:, :64]
    w = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(wide, w, 1e-6)[0], rms_norm(x, w, 1e-6)[0])


@bf16_kernel
@pytest.mark.parametrize("rows,inter", [(1, 2048), (4, 56), (9, 72), (64, 100)])
def test_silu_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's range ends and signed zero
    assert one_step(silu_mul(gate_up), silu_mul(gate_up, use_kernel=False))


def test_other_dtypes_and_layouts_take_the_torch_path():
    x = torch.randn(3, 16, dtype=torch.float64)
    w = torch.ones(16, dtype=torch.float64)
    norm, total = rms_norm(x, w, 1e-6, torch.ones(3, 16, dtype=torch.float64))
    assert torch.equal(total, x + 1) and norm.dtype == torch.float64
    ones = torch.ones(2, 8, dtype=torch.float64)
    assert torch.equal(silu_mul(ones), torch.nn.functional.silu(ones[:, :4]))


@pytest.mark.parametrize("rows,width", [(1, 768), (3, 40), (8, 36), (33, 1000), (130, 17)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_in_float32_matches_torch_and_float64(rows, width, with_residual):
    """csrc/fused_f32.c (a bf16 checkpoint computed in float32): the residual add exact, the norm within float32
    summation-order error of the torch path, and both near a float64 reference."""
    if fused_f32_kernel() is None:
        pytest.skip(f"kernel fused_f32 unsupported here: {unsupported_reason('fused_f32')}")
    g = torch.Generator().manual_seed(rows * width + 1)
    x, w = torch.randn(rows, width, generator=g) * 3, torch.rand(width, generator=g) + 0.5
    res = torch.randn(rows, width, generator=g) if with_residual else None
    ref_norm, ref_sum = rms_norm(x, w, 1e-5, None if res is None else res.clone(), use_kernel=False)
    norm, total = rms_norm(x, w, 1e-5, None if res is None else res.clone())
    assert torch.equal(total, ref_sum)
    s = total.double()
    exact = w.double() * s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(norm.double(), exact, rtol=1e-5, atol=1e-6)
    assert torch.allclose(norm, ref_norm, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(rms_norm(x, w * 1.001, 1e-5, None if res is None else res.clone())[0], ref_norm,
                              rtol=1e-5, atol=1e-6)  # the test can fail: a weight off by 0.1% is seen


@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 56), (9, 72), (64, 100)])
def test_silu_mul_in_float32_matches_torch_and_float64(rows, inter):
    """csrc/fused_f32.c's exp polynomial: within 1e-6 (a few float32 roundings) of torch's SiLU and from a float64 reference, over
    exp's whole range (its ends, where exp saturates or underflows, and signed zero)."""
    if fused_f32_kernel() is None:
        pytest.skip(f"kernel fused_f32 unsupported here: {unsupported_reason('fused_f32')}")
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -87.0, 88.0])
    out = silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    assert torch.allclose(out.double(), exact, rtol=1e-6, atol=1e-30)
    assert torch.allclose(out, silu_mul(gate_up, use_kernel=False), rtol=1e-6, atol=1e-30)
    assert not torch.allclose(silu_mul(gate_up * 1.0001), out, rtol=1e-6, atol=1e-30)  # the test can fail
