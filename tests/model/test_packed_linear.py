"""The CPU linears against the portable one (F.linear) and an exact reference.

oneDNN-prepacked weights and the C kernel (csrc/linear_bf16.c) sum in another order than F.linear may (oneDNN
picks its kernel by CPU and by weight layout: on AMX CPUs the prepacked and the plain weight take different
ones), so each output must be the exact (float64) value rounded to bf16, give or take one rounding step, which
is what F.linear itself achieves.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import ARCH_CONFIGS, needs_kernel, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.model.loader import load_model
from twospeed.model.packed_linear import (AMX_KERNEL_MAX_ROWS, TILES_MAX_ROWS, TILES_MIN_ROWS,
                                          PackedLinear, amx_kernel, can_use_onednn, has_amx, linear_kernel,
                                          onednn_rows, resolve_linear_backend, widen_kernel)

needs_onednn = pytest.mark.skipif(not can_use_onednn("cpu", torch.bfloat16), reason="no oneDNN bf16 kernels here")
needs_linear_kernel = needs_kernel(linear_kernel, "linear_bf16")
needs_widen_kernel = needs_kernel(widen_kernel, "linear_widen")

SHAPES = [((40, 72), False), ((72, 40), True), ((768, 2048), False), ((13, 301), True), ((14, 301), True),
          ((64, 130), False)]


def bf16_linear(shape, bias, rows, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(*shape, bias=bias).to(torch.bfloat16).requires_grad_(False)
    return lin, torch.randn(rows, shape[0], dtype=torch.bfloat16)


def within_one_rounding(y: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> bool:
    """|y - exact| <= one bf16 step at |exact|, plus float32 summation error (K terms)."""
    w = lin.weight.double()
    exact = x.double() @ w.T + (lin.bias.double() if lin.bias is not None else 0)
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    fp32_err = (x.double().abs() @ w.abs().T) * x.shape[1] * 2.0 ** -23
    return bool(((y.double() - exact).abs() <= step + fp32_err).all())


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 37, 64, 300, 600])  # 37, 300 and 600 run padded (onednn_rows)
@pytest.mark.parametrize("shape,bias", SHAPES)
def test_onednn_packing_is_exact_up_to_one_bf16_rounding(rows, shape, bias):
    lin, x = bf16_linear(shape, bias, rows, rows)
    y = PackedLinear.from_linear(lin, "onednn")(x)
    assert y.shape == (rows, shape[1]) and y.dtype == torch.bfloat16
    assert within_one_rounding(y, x, lin)
    assert within_one_rounding(F.linear(x, lin.weight, lin.bias), x, lin)  # the bound is the portable path's own


@needs_linear_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("shape,bias", SHAPES)
def test_kernel_is_exact_up_to_one_bf16_rounding(rows, shape, bias):
    lin, x = bf16_linear(shape, bias, rows, rows)
    packed = PackedLinear.from_linear(lin, "cpu")
    assert packed.backend == ("cpu" if shape[0] % 2 == 0 else "onednn")  # odd input width: no k pairs
    if packed.backend == "cpu":  # the C kernel itself, at every row count
        def kernel(x):
            return packed.packed.kernel(x, packed.bias)
    else:
        kernel = packed
    y = kernel(x)
    assert y.shape == (rows, shape[1]) and y.dtype == torch.bfloat16
    assert within_one_rounding(y, x, lin)
    assert within_one_rounding(packed(x), x, lin)  # what forward picks (on AMX CPUs: oneDNN beyond a few rows)
    assert within_one_rounding(F.linear(x, lin.weight, lin.bias), x, lin)  # the bound F.linear meets too
    if rows:
        # rows are independent: each alone gives what it gave in the batch
        assert torch.equal(kernel(x[-1:]), y[-1:])
        # a strided row view (a slice of a wider tensor) reads the same numbers
        wide = torch.cat([x, torch.zeros(rows, 6, dtype=x.dtype)], dim=1)[:, :shape[0]]
        assert torch.equal(kernel(wide), y)


@needs_linear_kernel
def test_amx_cpus_send_many_rows_to_onednn_and_few_to_the_kernel():
    lin, _ = bf16_linear((64, 130), False, 1, 0)
    packed = PackedLinear.from_linear(lin, "cpu")
    assert (packed.packed.wide is not None) == (has_amx() and can_use_onednn("cpu", torch.bfloat16))
    if packed.packed.wide is None:
        pytest.skip("no AMX here: the kernel takes every row count")
    tiles = packed.packed.tiles is not None
    top = TILES_MAX_ROWS if tiles else AMX_KERNEL_MAX_ROWS
    few, many = (torch.randn(n, 64, dtype=torch.bfloat16) for n in (TILES_MIN_ROWS - 1, top + 1))
    assert torch.equal(packed(few), packed.packed.kernel(few, None))
    onednn = PackedLinear.from_linear(lin, "onednn")
    assert torch.equal(packed(many), onednn(many))
    if tiles:  # batched decode rows take the AMX kernel
        mid = torch.randn(TILES_MIN_ROWS + 3, 64, dtype=torch.bfloat16)
        assert torch.equal(packed(mid), packed.packed.amx(mid, None))


@pytest.mark.skipif(amx_kernel() is None, reason="no AMX kernel here (AMX, a compiler for it, the tile state)")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("shape,bias", [((64, 130), True), ((96, 64), False), ((2048, 96), True)])
def test_amx_kernel_is_exact_up_to_one_bf16_rounding(rows, shape, bias):
    """The AMX kernel against float64, at row counts inside and across its 16-row tiles and 32-row chunks, output
    widths that end mid-block, with and without bias, from a strided row view."""
    lin, x = bf16_linear(shape, bias, rows, rows)
    packed = PackedLinear.from_linear(lin, "cpu").packed
    y = packed.amx(x, lin.bias)
    assert y.shape == (rows, shape[1]) and within_one_rounding(y, x, lin)
    assert torch.equal(packed.amx(x[-1:], lin.bias), y[-1:])  # rows are independent
    wide = torch.cat([x, torch.zeros(rows, 6, dtype=x.dtype)], dim=1)[:, :shape[0]]
    assert torch.equal(packed.amx(wide, lin.bias), y)


def test_backend_names_are_checked():
    assert resolve_linear_backend("auto", "cpu", torch.float32) == "torch"  # fp32 keeps the portable path
    assert resolve_linear_backend("torch", "cpu", torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="linear_backend must be"):
        resolve_linear_backend("mkl", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend 'cpu'"):
        resolve_linear_backend("cpu", "cpu", torch.float32)


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_linear_kernel), pytest.param("onednn", marks=needs_onednn)])
def test_packed_model_replaces_every_linear_and_counts_the_same_bytes(tmp_path, backend):
    write_hf_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    plain = load_model(tmp_path, torch.bfloat16, linear_backend="torch")
    packed = load_model(tmp_path, torch.bfloat16, linear_backend=backend)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) and m.backend == backend for m in packed.modules()) == 4 * len(packed.layers) + 1
    assert packed.weight_bytes() == plain.weight_bytes()
    # float32 compute over bf16 bytes widens them in the AVX2 kernel where it builds; float32 bytes stay portable
    assert load_model(tmp_path, torch.float32).lm_head.backend == ("widen" if widen_kernel() else "torch")
    write_hf_checkpoint(tmp_path / "f32", "llama", dtype=torch.float32)
    assert load_model(tmp_path / "f32", torch.float32).lm_head.backend == "torch"


def greedy_runs(tmp_path, arch: str, backends: tuple[str, ...], dtype: str = "bfloat16") -> list:
    """The same prompts, greedy with logprobs, through an engine per linear backend (chunked: steps mix
    decodes and prefill chunks), on a bf16 checkpoint computed in `dtype`."""
    write_hf_checkpoint(tmp_path, arch, dtype=torch.bfloat16)
    vocab = ARCH_CONFIGS[arch][2]["vocab_size"]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 33, 70)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    runs = []
    for backend in backends:
        llm = LLM(str(tmp_path), dtype=dtype, skip_tokenizer_init=True, linear_backend=backend,
                  max_num_batched_tokens=24, num_gpu_blocks=64)
        assert llm.engine.model.lm_head.backend == resolve_linear_backend(backend, "cpu", llm.engine.dtype,
                                                                          stored=torch.bfloat16)
        runs.append(llm.generate(prompts, params))
    return runs


@needs_onednn
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_engine_tokens_and_logprobs_identical_with_onednn_packing(tmp_path, arch):
    for a, b in zip(*greedy_runs(tmp_path, arch, ("torch", "onednn"))):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]


def agree_up_to_near_ties(a, b, logprob_abs: float) -> None:
    """Greedy tokens equal, or at the first difference a near tie: each side's token in the other's top 3."""
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if ta != tb:
            assert ta in b.logprobs[i].top and tb in a.logprobs[i].top
            break
        assert a.logprobs[i].logprob == pytest.approx(b.logprobs[i].logprob, abs=logprob_abs)


@needs_linear_kernel
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_engine_with_the_kernel_agrees_with_the_portable_path(tmp_path, arch):
    for a, b in zip(*greedy_runs(tmp_path, arch, ("torch", "cpu"))):
        agree_up_to_near_ties(a, b, 0.05)


# -- bf16 weights for float32 activations (csrc/linear_widen.c) --------------------------------------------------
def widened_linear(shape, bias, rows, seed):
    """A float32 linear holding bf16 values (a bf16 checkpoint loaded in float32) and float32 activations."""
    torch.manual_seed(seed)
    lin = nn.Linear(*shape, bias=bias).requires_grad_(False)
    lin.weight.copy_(lin.weight.bfloat16().float())
    return lin, torch.randn(rows, shape[0])


def within_fp32_summation(y: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> bool:
    """|y - exact| <= (K + 1) u sum |x w| + |b| (u = 2^-24): float32 summation's bound in any order."""
    w = lin.weight.double()
    bias = lin.bias.double() if lin.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    exact = x.double() @ w.T + bias
    bound = (x.double().abs() @ w.abs().T + bias.abs()) * (x.shape[1] + 1) * 2.0 ** -24
    return bool(((y.double() - exact).abs() <= bound).all())


@needs_widen_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 37, 300])  # streamed up to 8 rows, chunked past
@pytest.mark.parametrize("shape,bias", SHAPES)
def test_widening_kernel_is_float32_exact_up_to_summation(rows, shape, bias):
    lin, x = widened_linear(shape, bias, rows, rows)
    packed = PackedLinear.from_linear(lin, "widen")
    assert packed.packed.weight.dtype == torch.bfloat16 and packed.dtype_bytes == 2  # half the bytes a step reads
    y = packed(x)
    assert y.shape == (rows, shape[1]) and y.dtype == torch.float32
    assert within_fp32_summation(y, x, lin)
    assert within_fp32_summation(F.linear(x, lin.weight, lin.bias), x, lin)  # the bound is the portable path's own
    strided = torch.cat([x, torch.zeros(rows, 5)], dim=1)[:, :shape[0]]
    assert torch.equal(packed(strided), y)


@needs_widen_kernel
@pytest.mark.parametrize("shape,bias", SHAPES)
def test_widening_kernel_gives_a_row_the_same_bits_in_any_batch(shape, bias):
    """Streamed (up to 8 rows) or widened once into chunks (more), every output is the same FMA chain over k, so a
    row's output is the one it gets alone (a stream's tokens do not depend on its batch), a prefill chunk's too."""
    lin, x = widened_linear(shape, bias, 300, 37)
    packed = PackedLinear.from_linear(lin, "widen")
    y = packed(x)
    for r in (0, 5, 36, 299):
        for width in (1, 2, 3, 6, 9, 37):
            assert torch.equal(packed(x[r:r + width]), y[r:r + width])


@pytest.mark.parametrize("packing,make,within,rows", [
    pytest.param("cpu", bf16_linear, within_one_rounding, 9, marks=needs_linear_kernel),
    pytest.param("widen", widened_linear, within_fp32_summation, 3, marks=needs_widen_kernel)])
def test_a_kernel_catches_a_wrong_weight(packing, make, within, rows):
    """The reference checks are not vacuous: one changed weight moves outputs by more than the bound."""
    lin, x = make((64, 130), False, rows, 0)
    packed = PackedLinear.from_linear(lin, packing)
    lin.weight[77, 3] += 1.0
    assert not within(packed(x), x, lin)


@needs_widen_kernel
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_a_bf16_checkpoint_computed_in_float32_widens_and_agrees_with_the_portable_path(tmp_path, arch):
    """dtype float32 over a bf16 checkpoint: "cpu" (as "auto" where no bf16 kernel runs) keeps the weights in
    bf16 for the widening kernel; tokens and logprobs agree with float32 F.linear up to float32 summation."""
    torch_run, widen_run = greedy_runs(tmp_path, arch, ("torch", "cpu"), dtype="float32")
    for a, b in zip(torch_run, widen_run):
        agree_up_to_near_ties(a, b, 1e-3)
    assert resolve_linear_backend("auto", "cpu", torch.float32, stored=torch.bfloat16) == "widen"
    assert resolve_linear_backend("auto", "cpu", torch.float32, stored=torch.float32) == "torch"  # fp32 weights stay


def test_onednn_row_buckets_cover_every_count_with_few_shapes():
    """Every row count runs at a bucket >= itself that pads it by under a quarter (under 32 rows up to 128), and
    the whole range of a 4096-token budget needs under a hundred shapes (each built once by oneDNN)."""
    buckets = {onednn_rows(m) for m in range(1, 4097)}
    assert all(0 <= onednn_rows(m) - m < max(32, m // 4) for m in range(1, 4097))
    assert all(onednn_rows(m) == m for m in range(1, 33)) and len(buckets) < 100
