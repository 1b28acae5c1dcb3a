"""Weight-only int8 / fp8: the quantizers, both C kernels and the portable path against a float64 reference of the
dequantized weights, planted errors caught, and the engine's greedy tokens equal between the kernel and the
portable path.

The bound: each output is the exact (float64) product with the dequantized weight, rounded once to bf16, give or
take one bf16 rounding step plus float32 summation error over K terms: what F.linear meets for bf16 weights.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCH_CONFIGS, write_hf_checkpoint
from twospeed import LLM, SamplingParams
from twospeed.config import EngineConfig
from twospeed.schema import formats
from twospeed.model.loader import CheckpointError, load_model
from twospeed.model.packed_linear import widen_kernel
from twospeed.model.quant import FORMATS, Fp8Format, Int8Format, Q8Kernel, Q8Linear, q8_kernel
from twospeed.model.weight_format import make_weight_format

needs_kernel = pytest.mark.skipif(q8_kernel() is None, reason="no C compiler or no AVX-512 BF16 on this CPU")
SHAPES = [(40, 64), (130, 96), (13, 300), (64, 130), (768, 512)]  # (N, K); K=130/300: no AMX (K % 32)


def within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """|y - exact| <= one bf16 step at |exact| + float32 summation error; w is the dequantized weight."""
    w = w.double()
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    fp32_err = (x.double().abs() @ w.abs().T) * x.shape[1] * 2.0 ** -23
    return bool(((y.double() - exact).abs() <= step + fp32_err).all())


def quantized(fmt, n, k, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n, k)
    w[0] = 0  # an all-zero row must survive
    q, scale = fmt.quantize(w)
    return w, q, scale


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_quantizer_is_symmetric_per_row(n, k):
    w, q, scale = quantized(Int8Format(False), n, k)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q[1:].abs().amax(dim=1), torch.full((n - 1,), 127, dtype=torch.int8))  # max |w| -> 127
    err = (Int8Format.dequantize(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())  # round to nearest: half a step per weight


@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_quantizer_keeps_three_mantissa_bits(n, k):
    w, q, scale = quantized(Fp8Format(False), n, k)
    assert q.dtype == torch.float8_e4m3fn and not q.float().isnan().any()
    deq = Fp8Format.dequantize(q, scale)
    normal = w.abs() >= scale[:, None] * 2.0 ** -6  # e4m3's smallest normal, scaled
    assert bool(((deq - w).abs()[normal] <= w.abs()[normal] * 2.0 ** -4 * (1 + 1e-6)).all())  # half an ulp
    assert bool(((deq - w).abs()[~normal] <= scale[:, None].expand_as(w)[~normal] * 2.0 ** -10 * (1 + 1e-6)).all())


@needs_kernel
@pytest.mark.parametrize("fmt", [Int8Format(True), Fp8Format(True)], ids=["int8", "fp8"])
@pytest.mark.parametrize("n,k", [s for s in SHAPES if s[1] % 2 == 0])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 31, 33, 64, 300])
def test_kernels_match_the_dequantized_reference(fmt, n, k, rows):
    _, q, scale = quantized(fmt, n, k, seed=rows)
    deq = fmt.dequantize(q, scale)
    kernel = Q8Kernel(q, scale, fmt.kernel_code)
    bias = torch.randn(n, dtype=torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    for wide in (False, True) if kernel.amx else (False,):
        y = kernel.forward(x, bias, wide=wide)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        assert within_bound(y, x, deq, bias), f"wide={wide}"
    assert within_bound(kernel.forward(x, None), x, deq, None)  # what forward picks by the row count
    assert torch.equal(kernel.forward(x[-1:], bias), kernel.forward(x, bias, wide=False)[-1:])  # rows independent
    strided = torch.cat([x, torch.zeros(rows, 6, dtype=x.dtype)], dim=1)[:, :k]
    assert torch.equal(kernel.forward(strided, bias), kernel.forward(x, bias))


@pytest.mark.parametrize("fmt", [Int8Format(False), Fp8Format(False)], ids=["int8", "fp8"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_portable_path_matches_the_dequantized_reference(fmt, n, k):
    lin = fmt.linear(k, n, True)
    w = torch.randn(n, k)
    with torch.no_grad():
        lin.load_weight(lin.weight, w)
        lin.load_bias(lin.bias, torch.randn(n))
    lin.finish_loading()
    assert lin.kernel is None
    x = torch.randn(9, k)
    exact = x.double() @ lin.dequantized().double().T + lin.bias.double()
    # float32: the summation's error bound, k u sum |x w| (u = 2^-24); a rounding per partial sum, in whatever
    # order the CPU's GEMM adds (measured: 1.6 u on AVX2, where exact sums near zero fail any relative bound)
    sums = x.double().abs() @ lin.dequantized().double().abs().T + lin.bias.double().abs()
    assert bool(((lin(x).double() - exact).abs() <= sums * (k + 1) * 2.0 ** -24).all())
    xb = x.to(torch.bfloat16)
    assert within_bound(lin(xb), xb, lin.dequantized(), lin.bias)


needs_widen = pytest.mark.skipif(widen_kernel() is None, reason="no AVX2 widening kernel here")


@needs_widen
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 37, 300])  # streamed up to 8 rows, chunked past
def test_int8_with_float32_activations_widens_within_float32_summation(n, k, rows):
    """int8 on a CPU without bf16 kernels: csrc/linear_widen.c over the bytes, against the dequantized weight in
    float64 (float32 summation's bound) and the portable path; a planted scale error is caught."""
    fmt = make_weight_format("int8", "auto", "cpu", torch.float32)
    assert fmt.use_widen and not fmt.use_kernel
    lin = fmt.linear(k, n, True)
    with torch.no_grad():
        lin.load_weight(lin.weight, torch.randn(n, k))
        lin.load_bias(lin.bias, torch.randn(n))
    lin.finish_loading()
    assert "AVX2 widening" in lin.describe() and lin.panels.dtype == torch.int8  # one byte a weight stays
    x = torch.randn(rows, k)
    exact = x.double() @ lin.dequantized().double().T + lin.bias.double()
    sums = x.double().abs() @ lin.dequantized().double().abs().T + lin.bias.double().abs()

    def within(y: torch.Tensor) -> bool:
        return bool(((y.double() - exact).abs() <= sums * (k + 1) * 2.0 ** -24).all())

    y = lin(x)
    assert within(y) and within(lin.portable(x))
    for r in (0, rows - 1):  # every output one FMA chain over k: a row's bits do not depend on its batch
        assert torch.equal(lin(x[r:r + 1]), y[r:r + 1])
    lin.scale[n // 2] *= 1.02
    assert not within(lin(x))


@needs_kernel
def test_a_wrong_scale_is_caught():
    """Planted errors: the bound is not vacuous. One row's scale 2% off fails it; so does the test-only
    random-scale format against the weights it was given."""
    fmt = Int8Format(True)
    _, q, scale = quantized(fmt, 64, 128)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    deq = fmt.dequantize(q, scale)
    bad = scale.clone()
    bad[17] *= 1.02
    assert within_bound(Q8Kernel(q, scale, 0).forward(x, None), x, deq, None)
    assert not within_bound(Q8Kernel(q, bad, 0).forward(x, None), x, deq, None)
    w = torch.randn(64, 128)
    qr, sr = FORMATS["test-random-scale"](False).quantize(w)
    assert (FORMATS["test-random-scale"].dequantize(qr, sr) - w).abs().max() > 10 * (fmt.quantize(w)[1].max() / 2)


def test_format_names_and_backends_are_checked():
    with pytest.raises(ValueError, match="int8, fp8"):
        EngineConfig(model="demo", quantization="int3")
    assert EngineConfig(model="demo", quantization="none").quantization is None
    with pytest.raises(ValueError, match="no oneDNN path"):
        make_weight_format("int8", "onednn", "cpu", torch.bfloat16)
    assert not make_weight_format("int8", "torch", "cpu", torch.bfloat16).use_kernel
    assert not make_weight_format("fp8", "auto", "cpu", torch.float32).use_kernel  # fp32 activations: portable
    assert not make_weight_format("fp8", "auto", "cpu", torch.float32).use_widen  # (the AVX2 kernel is int8 only)
    assert not make_weight_format("int8", "torch", "cpu", torch.float32).use_widen
    assert {"int8", "fp8"} <= set(formats.QUANTIZATIONS)  # the test-only formats are accepted but not listed
    assert set(FORMATS) - set(formats.QUANTIZATIONS) == {"test-int4-per-tensor", "test-random-scale"}


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_model_loads_every_linear_and_counts_its_bytes(tmp_path, quantization):
    write_hf_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)  # q/k/v biases, tied embeddings
    model = load_model(tmp_path, torch.bfloat16, quantization=quantization)
    linears = [m for m in model.modules() if isinstance(m, Q8Linear)]
    assert len(linears) == 4 * len(model.layers) + 1 and model.lm_head in linears  # the logits too
    cfg = model.cfg
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    rows = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    per_layer = sum(n * k + 4 * n for n, k in rows) + (q + 2 * kv) * 2 + 2 * h * 2  # + qkv bias, norms (bf16)
    assert model.weight_bytes() == cfg.num_layers * per_layer + cfg.vocab_size * (h + 4) + h * 2
    dense = load_model(tmp_path, torch.bfloat16)
    assert dense.weight_bytes() > 1.7 * model.weight_bytes()


def test_quantized_loader_still_names_a_misshapen_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    write_hf_checkpoint(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 40)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*\(7, 40\)"):
        load_model(tmp_path, quantization="int8")


def greedy(tmp_path, arch: str, quantization: str, backends: tuple[str, ...]) -> list:
    write_hf_checkpoint(tmp_path, arch, dtype=torch.bfloat16)
    vocab = ARCH_CONFIGS[arch][2]["vocab_size"]
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for backend in backends:
        llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, quantization=quantization,
                  linear_backend=backend, max_num_batched_tokens=24, num_gpu_blocks=64)  # steps mix decodes, chunks
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
    return runs


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_greedy_tokens_identical_between_the_kernel_and_the_portable_path(tmp_path, arch, quantization):
    kernel, portable = greedy(tmp_path, arch, quantization, ("cpu", "torch"))
    assert kernel == portable


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied, tied embeddings
def test_the_planner_prices_weights_as_the_engine_holds_them(tmp_path, arch):
    """plan/precision.py (torch-free) against the loaded model's own byte count in every format: the same bytes,
    plus the embedding table where it is a tensor of its own (untied, or beside a quantized head)."""
    from twospeed.plan.precision import weight_bytes

    write_hf_checkpoint(tmp_path, arch, dtype=torch.bfloat16)
    for quantization in (None, "int8", "fp8"):
        model = load_model(tmp_path, torch.bfloat16, quantization=quantization)
        cfg = model.cfg
        separate = quantization is not None or not cfg.tie_word_embeddings
        embed = cfg.vocab_size * cfg.hidden_size * 2 if separate else 0
        assert weight_bytes(cfg, "bfloat16", quantization) == model.weight_bytes() + embed, quantization
