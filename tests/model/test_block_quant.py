"""Block-quantized weights kept packed (q8_0, q4_0, q4_1, q4_k, gguf): the layouts against the gguf package, the
C kernels against the portable path and a float64 reference, GGUF files loaded packed against the same files
dequantized, and the byte counts the planner reads.

The bounds (model/block_quant.py):
- the kernel (any number of rows) multiplies the dequantized weights by activations quantized to int8
  per block of 32 (x~ = dx round(x / dx), dx = max|x_b| / 127): against the float64 product with x~ it is exact up
  to float32 summation; against the float64 product with x it is within sum_b dx_b / 2 sum_{i in b} |w_i|;
- the portable path multiplies the exact dequantized weights: float32 summation only;
- bf16 activations add the output's one bf16 rounding.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import needs_kernel, write_hf_checkpoint
from test_gguf import spm_vocab, tiny_hf, write_gguf
from twospeed.schema import formats
from twospeed.model.block_kinds import KINDS, BlockKind, BlockTensor, quantize_kernel
from twospeed.model.block_quant import FORMATS, BlockLinear, qblock_kernel
from twospeed.model.loader import load_model
from twospeed.model.weight_format import make_weight_format

KERNEL = needs_kernel(qblock_kernel, "linear_qblock")
QUANT_KERNEL = needs_kernel(quantize_kernel, "linear_qblock_quant")
GGUF_QUANTIZES = ("Q8_0", "Q4_0", "Q4_1")  # gguf's own quantizer covers these (not Q4_K)
LIBGGML = Path(__file__).resolve().parents[2] / "benchmarks/peers/.work/llama-build/bin/libggml-base.so"
FORMAT_OF = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k"}


def awkward_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """Weights with the cases a quantizer gets wrong: a zero row, a constant run, one spike, a negative peak,
    scales from 1e-4 to 30."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * torch.logspace(-4, 1.5, rows)[:, None]
    w[0] = 0
    if rows > 3:
        w[1, : k // 2] = 0.75
        w[2, 3] = 50.0
        w[3, :32] = -w[3, :32].abs() * 4
    return w


def gguf_dequantize(kind: BlockKind, data: torch.Tensor, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(data.numpy(), getattr(Q, kind.name))).reshape(-1, k)


# -- layouts ------------------------------------------------------------------------------------------------------
@QUANT_KERNEL
@settings(max_examples=30)
@given(name=st.sampled_from(GGUF_QUANTIZES), rows=st.integers(1, 9), blocks=st.integers(1, 12), seed=st.integers(0, 99))
def test_quantizers_write_ggufs_bytes(name, rows, blocks, seed):
    kind = KINDS[name]
    w = awkward_rows(rows, 32 * blocks, seed)
    want = gguf.quants.quantize(w.numpy(), getattr(Q, name))
    assert np.array_equal(kind.quantize(w).numpy(), want)  # C
    assert np.array_equal(kind.quantize_portable(w).numpy(), want)  # torch
    assert np.array_equal(kind.quantize(w.bfloat16()).numpy(), gguf.quants.quantize(w.bfloat16().float().numpy(),
                                                                                    getattr(Q, name)))


@settings(max_examples=30)
@given(name=st.sampled_from(sorted(KINDS)), rows=st.integers(1, 6), blocks=st.integers(1, 3), seed=st.integers(0, 99))
def test_dequantizers_are_ggufs_bit_for_bit(name, rows, blocks, seed):
    """Random bytes (scales made finite) and quantized weights: gguf's float32 values exactly."""
    kind = KINDS[name]
    k = kind.block * blocks
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows * blocks, kind.block_bytes), dtype=torch.uint8, generator=g)
    for at in {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}.get(name, (0,)):  # fp16 scale (and min) fields
        raw[:, at:at + 2] = (torch.rand(rows * blocks, 1, generator=g) * 0.1 - 0.02).half().view(torch.uint8)
    quantized = [] if name == "Q6_K" else [kind.quantize_portable(awkward_rows(rows, k, seed))]  # no Q6_K quantizer
    for data in (raw.reshape(rows, -1), *quantized):
        want = gguf_dequantize(kind, data, k)
        assert torch.equal(kind.dequantize(data, k).view(torch.int32), want.view(torch.int32))


@settings(max_examples=30)
@given(name=st.sampled_from([*GGUF_QUANTIZES, "Q4_K", "Q6_K"]), rows=st.integers(1, 27), blocks=st.integers(1, 3),
       seed=st.integers(0, 99))
def test_grouped_rows_are_ggufs_bytes_in_the_kernels_order(name, rows, blocks, seed):
    """group_rows (the kernel's layout) moves bytes only: each field of a block (scales, quants) of a group's 8 rows
    side by side, row j's `run` bytes at run * j of every 8 * run; ungroup_rows undoes it."""
    kind = KINDS[name]
    k = kind.block * blocks
    data = random_q6_k(rows, k, seed) if name == "Q6_K" else kind.quantize_portable(awkward_rows(rows, k, seed))
    grouped = kind.group_rows(data)
    assert grouped.shape == data.shape and torch.equal(kind.ungroup_rows(grouped), data)
    assert torch.equal(grouped[rows // 8 * 8:], data[rows // 8 * 8:])  # the tail stays in GGUF's rows
    bb = kind.block_bytes
    spans = sorted((at, at + n) for at, n, _ in kind.x8_fields)  # the fields cover the block's bytes once each
    assert spans[0][0] == 0 and spans[-1][1] == bb and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for g in range(rows // 8):
        flat = grouped[8 * g:8 * g + 8].reshape(-1)
        for j in range(8):
            row = data[8 * g + j]
            for b in range(blocks):
                start = b * 8 * bb
                for at, n, run in kind.x8_fields:
                    field = flat[start:start + 8 * n].reshape(-1, 8, run)[:, j].reshape(-1)
                    assert torch.equal(field, row[b * bb + at:b * bb + at + n]), (at, j, b)
                    start += 8 * n


@QUANT_KERNEL
def test_q4_k_quantizer_is_llama_cpps():
    """The C quantizer is llama.cpp's quantize_row_q4_K_ref (the same bytes, where a built llama.cpp is at hand);
    the torch one sums in another order: nearly every super-block the same, the error no larger."""
    kind = KINDS["Q4_K"]
    w = awkward_rows(24, 1024, 7)
    ours = kind.quantize(w)
    portable = kind.quantize_portable(w)
    same = (ours.reshape(-1, 144) == portable.reshape(-1, 144)).all(dim=1).float().mean()
    assert same >= 0.95
    err = [(kind.dequantize(d, 1024) - w).pow(2).sum() for d in (ours, portable)]
    assert err[1] <= err[0] * 1.01
    rel = ((kind.dequantize(ours, 1024) - w)[4:].pow(2).mean(1) / w[4:].pow(2).mean(1)).sqrt()
    assert rel.max() < 0.1  # 4.5 bits a weight on Gaussian rows: about 7% RMS
    if not LIBGGML.exists():
        pytest.skip("no built llama.cpp (benchmarks/peers/setup.sh) to compare bytes with")
    lib = ctypes.CDLL(str(LIBGGML))
    lib.quantize_row_q4_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    theirs = torch.empty_like(ours)
    for r in range(w.shape[0]):
        lib.quantize_row_q4_K_ref(w[r].contiguous().data_ptr(), theirs[r].data_ptr(), 1024)
    assert torch.equal(ours, theirs)


# -- kernels ------------------------------------------------------------------------------------------------------
def block_linear(quantization: str, n: int, k: int, bias: bool, seed: int = 0, use_kernel: bool = True):
    fmt = FORMATS[quantization](use_kernel=use_kernel)
    g = torch.Generator().manual_seed(seed)
    lin = fmt.linear(k, n, bias)
    lin.load_weight(lin.weight, torch.randn(n, k, generator=g))
    if bias:
        lin.load_bias(lin.bias, torch.randn(n, generator=g))
    lin.finish_loading()
    return lin


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x~ in float64, dx per block), as csrc/linear_qblock.c quantizes x: dx = max|x_b| / 127, q = nearest even of
    x * (127 / max|x_b|)."""
    m, k = x.shape
    b = x.float().reshape(m, k // 32, 32)
    top = b.abs().amax(dim=2, keepdim=True)
    safe = torch.where(top > 0, top, torch.ones_like(top))
    inv = torch.where(top > 0, torch.full_like(top, 127) / safe, torch.zeros_like(top))  # one rounding, as C's
    dx = top / 127
    return (torch.round(b * inv).double() * dx.double()).reshape(m, k), dx[..., 0]


def float32_error(x: torch.Tensor, w: torch.Tensor, terms: int) -> torch.Tensor:
    """Float32 summation over `terms` partial sums, generously: terms * 2^-23 * sum |x| |w|."""
    return (x.abs() @ w.abs().T) * (terms + 8) * 2.0 ** -23


def bf16_step(y: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(1e-30))) - 7)


@KERNEL
@settings(max_examples=60)
@given(quantization=st.sampled_from(["q8_0", "q4_0", "q4_1", "q4_k"]), n=st.integers(1, 70), blocks=st.integers(1, 9),
       rows=st.integers(1, 40), bias=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 999))
def test_kernel_is_exact_for_its_quantized_activations_and_within_the_stated_bound(
        quantization, n, blocks, rows, bias, bf16, seed):
    lin = block_linear(quantization, n, 32 * blocks * (8 if quantization == "q4_k" else 1), bias, seed)
    k = lin.in_features
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)) * 3
    x[0, :32] = 0  # an all-zero activation block
    if bf16:
        x = x.bfloat16()
    y = lin.forward(x).double()
    w = lin.dequantized().double()
    b = 0 if lin.bias is None else lin.bias.double()
    xq, dx = quantized_activations(x)
    out_step = bf16_step(y) if bf16 else 0
    # the product with the quantized activations: float32 summation only
    assert ((y - (xq @ w.T + b)).abs() <= float32_error(xq, w, k // 32) + out_step).all()
    # the stated bound against the exact product with x
    xd = x.double()
    bound = (dx.double() / 2) @ w.abs().reshape(n, k // 32, 32).sum(dim=2).T * (1 + 2.0 ** -20)
    assert ((y - (xd @ w.T + b)).abs() <= bound + float32_error(xd, w, k // 32) + out_step).all()
    # a row's result does not depend on the rows beside it
    assert torch.equal(lin.forward(x[-1:]).double(), y[-1:])


@settings(max_examples=30)
@given(quantization=st.sampled_from(["q8_0", "q4_0", "q4_1", "q4_k"]), n=st.integers(1, 70), blocks=st.integers(1, 4),
       rows=st.integers(1, 40), bias=st.booleans(), seed=st.integers(0, 999))
def test_portable_path_multiplies_the_exact_weights(quantization, n, blocks, rows, bias, seed):
    lin = block_linear(quantization, n, 32 * blocks * (8 if quantization == "q4_k" else 1), bias, seed)
    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(seed))
    w = lin.dequantized().double()
    exact = x.double() @ w.T + (0 if lin.bias is None else lin.bias.double())
    assert ((lin.portable(x).double() - exact).abs() <= float32_error(x.double(), w, lin.in_features)).all()


@KERNEL
@pytest.mark.parametrize("quantization", ["q8_0", "q4_1", "q4_k"])
def test_a_prompt_chunk_takes_the_kernel_row_by_row(quantization):
    """Rows past one register pass and one cache tile (1024 inputs: 24 rows a tile), weight rows past whole groups
    of 8 (N = 83): each row's output is what it gets alone, within the bound of the float64 reference."""
    lin = block_linear(quantization, 83, 1024, True, 3)
    x = torch.randn(61, 1024, generator=torch.Generator().manual_seed(4))
    y = lin.forward(x)
    for r in (0, 7, 8, 23, 24, 47, 60):
        assert torch.equal(lin.forward(x[r:r + 1]), y[r:r + 1]), r
    w = lin.dequantized().double()
    xq, _ = quantized_activations(x)
    exact = xq @ w.T + lin.bias.double()
    assert ((y.double() - exact).abs() <= float32_error(xq, w, 32)).all()


def random_q6_k(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q6_K bytes [n, row_bytes] with small finite fp16 d (what a file holds, bit patterns aside)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * (k // 256), 210), dtype=torch.uint8, generator=g)
    raw[:, 208:210] = (torch.rand(raw.shape[0], 1, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8)
    return raw.reshape(n, -1)


@KERNEL
@settings(max_examples=25)
@given(n=st.integers(1, 20), supers=st.integers(1, 3), rows=st.integers(1, 20), bf16=st.booleans(),
       seed=st.integers(0, 999))
def test_q6_k_kept_as_stored_is_exact_for_its_quantized_activations(n, supers, rows, bf16, seed):
    """`gguf` keeps a file's Q6_K tensor as stored: gguf's values, and the kernel within the bound."""
    kind, k = KINDS["Q6_K"], 256 * supers
    raw = random_q6_k(n, k, seed)
    lin = FORMATS["gguf"](use_kernel=True).linear(k, n, False)
    lin.load_weight(lin.weight, BlockTensor(kind, raw, (n, k)))
    lin.finish_loading()
    assert [p.kind.name for p in lin.parts] == ["Q6_K"] and lin.nbytes == raw.numel()
    w = lin.dequantized()
    assert torch.equal(w.view(torch.int32), gguf_dequantize(kind, raw, k).view(torch.int32))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)) * 3
    if bf16:
        x = x.bfloat16()
    y = lin.forward(x).double()
    xq, _ = quantized_activations(x)
    w = w.double()
    assert ((y - xq @ w.T).abs() <= float32_error(xq, w, k // 32) + (bf16_step(y) if bf16 else 0)).all()
    assert torch.equal(lin.forward(x[-1:]).double(), y[-1:])
    with pytest.raises(ValueError, match="Q6_K"):
        kind.quantize(torch.randn(2, 256))


@KERNEL
def test_a_wrong_scale_is_caught():
    """The bound has teeth: one weight block's scale off by 2% fails it."""
    lin = block_linear("q4_0", 16, 256, False)
    x = torch.randn(4, 256)
    y = lin.forward(x).double()
    part = lin.parts[0]
    rows = part.gguf_rows().clone()
    rows[5, 18:20] = (rows[5, 18:20].view(torch.float16) * 1.02).view(torch.uint8)  # row 5, block 1's scale
    part.data.copy_(part.kind.group_rows(rows) if part.grouped else rows)
    xq, _ = quantized_activations(x)
    w = lin.dequantized().double()
    assert not ((y - xq @ w.T).abs() <= float32_error(xq, w, 8)).all()


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1", "q4_k", "gguf"])
def test_widths_that_are_not_whole_blocks_are_refused(quantization):
    with pytest.raises(ValueError, match=r"blocks of 32 along the input: a linear of 40 inputs"):
        make_weight_format(quantization, "auto", "cpu", torch.float32).linear(40, 8, False)
    q4k = make_weight_format("q4_k", "auto", "cpu", torch.float32)
    assert q4k.linear(576, 8, False).kind.name == "Q4_0"  # not a multiple of 256: Q4_0, the same bytes
    assert q4k.linear(512, 8, False).kind.name == "Q4_K"
    with pytest.raises(ValueError, match="no oneDNN path"):
        make_weight_format(quantization, "onednn", "cpu", torch.float32)
    assert not make_weight_format(quantization, "torch", "cpu", torch.float32).use_kernel


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_linear_bytes_are_the_planners(quantization):
    for n, k in ((8, 256), (130, 512), (3, 1024)):
        lin = block_linear(quantization, n, k, True, use_kernel=False)
        assert lin.nbytes == formats.weight_format(quantization).linear(n, k, 4) + 4 * n
        assert lin.nbytes == lin.weight.numel() + 4 * n
    per_weight = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q4_k": 144 / 256}[quantization]
    assert formats.weight_format(quantization).per_weight == per_weight


# -- checkpoints --------------------------------------------------------------------------------------------------
def block_checkpoint(tmp_path, arch: str = "llama", tie: bool = False):
    """An HF checkpoint (float32) whose widths are whole blocks: hidden 64 (q4_k falls back to q4_0), MLP 256."""
    write_hf_checkpoint(tmp_path, arch, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    return tmp_path


def linears(model) -> dict[str, BlockLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BlockLinear)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied; tied embeddings with q/k/v biases
@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_quantized_at_load_model_counts_the_planners_bytes(tmp_path, arch, quantization):
    from twospeed.plan.precision import weight_bytes

    block_checkpoint(tmp_path, arch, tie=arch == "qwen2")
    model = load_model(tmp_path, torch.float32, quantization=quantization)
    found = linears(model)
    assert len(found) == 4 * len(model.layers) + 1 and model.lm_head in found.values()
    cfg = model.cfg
    assert weight_bytes(cfg, "float32", quantization) == model.weight_bytes() + cfg.vocab_size * cfg.hidden_size * 4
    kinds = {m.parts[0].kind.name for m in found.values()}
    assert kinds == ({"Q4_0", "Q4_K"} if quantization == "q4_k" else {quantization.upper()})


def gguf_file(tmp_path, types, tie: bool = False, seed: int = 0) -> tuple[Path, dict]:
    """A llama GGUF written by the gguf package (Q4_K bytes by llama.cpp's quantizer, ours in C); `types(name)`
    picks each matrix's type."""
    vocab = spm_vocab()
    hf = tiny_hf(vocab_size=len(vocab["tokens"]), tie=tie, seed=seed)
    with torch.no_grad():  # logits spread like a trained model's (near-uniform ones tie at every step)
        (hf.model.embed_tokens if tie else hf.lm_head).weight.mul_(8)
    path = tmp_path / "tiny.gguf"

    def encode(array, qtype, rng):  # test_gguf writes K-quants as random blocks: Q4_K here as quantized
        return KINDS["Q4_K"].quantize(torch.from_numpy(array)).numpy() if qtype == Q.Q4_K else original(array, qtype,
                                                                                                        rng)

    import test_gguf

    original = test_gguf.encode
    test_gguf.encode = encode
    try:
        written = write_gguf(path, hf, "llama", vocab, types)
    finally:
        test_gguf.encode = original
    return path, written


@QUANT_KERNEL
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_gguf_loaded_packed_holds_the_bytes_quantizing_at_load_writes(tmp_path, qtype):
    """Deterministic formats: the file's bytes (gguf's quantizer) and the same float weights quantized at load
    (from the file dequantized to F32: the HF weights) are one and the same."""
    packed_path, written = gguf_file(tmp_path, lambda name: getattr(Q, qtype))
    (tmp_path / "f32").mkdir()
    float_path, _ = gguf_file(tmp_path / "f32", lambda name: Q.F32)
    packed = load_model(packed_path, torch.float32, quantization=FORMAT_OF[qtype], linear_backend="torch")
    at_load = load_model(float_path, torch.float32, quantization=FORMAT_OF[qtype], linear_backend="torch")
    a, b = linears(packed), linears(at_load)
    for name in a:
        assert torch.equal(a[name].parts[0].data, b[name].parts[0].data), name
    stored = torch.from_numpy(np.ascontiguousarray(written["blk.1.ffn_down.weight"][1]))
    assert torch.equal(a["layers.1.mlp.down_proj"].parts[0].data, stored)  # byte for byte


def mixed_types(name: str):
    """Each layer's q/k/v in different types, so fused linears keep parts; every kept kind (Q6_K among them) and two
    that are not (Q5_0, F16: stored in q8_0)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    table = {"attn_q": [Q.Q4_0, Q.Q8_0], "attn_k": [Q.Q4_0, Q.Q4_1], "attn_v": [Q.Q5_0, Q.Q4_1],
             "attn_output": [Q.Q8_0, Q.F16], "ffn_gate": [Q.Q4_1, Q.Q8_0], "ffn_up": [Q.Q4_1, Q.Q8_0],
             "ffn_down": [Q.Q6_K, Q.Q4_K]}
    if layer >= 0:
        return table[name.split(".")[2]][layer]
    return {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0}[name]


@QUANT_KERNEL
def test_gguf_format_keeps_every_tensor_as_stored(tmp_path):
    path, written = gguf_file(tmp_path, mixed_types)
    model = load_model(path, torch.float32, quantization="gguf")
    found = linears(model)
    parts = {name: [(p.rows.stop - p.rows.start, p.kind.name) for p in m.parts] for name, m in found.items()}
    q, kv = 64, 32
    assert parts["layers.0.self_attn.qkv_proj"] == [(q + kv, "Q4_0"), (kv, "Q8_0")]  # Q5_0 -> q8_0
    assert parts["layers.1.self_attn.qkv_proj"] == [(q, "Q8_0"), (2 * kv, "Q4_1")]
    assert parts["layers.1.self_attn.o_proj"] == [(64, "Q8_0")]  # F16 -> q8_0
    assert parts["layers.0.mlp.gate_up_proj"] == [(512, "Q4_1")]
    assert parts["layers.0.mlp.down_proj"] == [(64, "Q6_K")]  # kept as stored
    assert parts["layers.1.mlp.down_proj"] == [(64, "Q4_K")]
    assert parts["lm_head"] == [(len(spm_vocab()["tokens"]), "Q4_0")]
    up = found["layers.0.mlp.gate_up_proj"].parts[0].gguf_rows()[256:]
    assert torch.equal(up, torch.from_numpy(np.ascontiguousarray(written["blk.0.ffn_up.weight"][1])))
    assert model.weight_bytes() == sum(m.nbytes for m in found.values()) + sum(
        p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    for lin in found.values():  # one kernel call per part, each into its own columns
        x = torch.randn(3, lin.in_features)
        w = lin.dequantized().double()
        xq, _ = quantized_activations(x)
        if lin.fmt.use_kernel:
            assert ((lin.forward(x).double() - xq @ w.T).abs() <= float32_error(xq, w, lin.in_features // 32)).all()
        assert ((lin.portable(x).double() - x.double() @ w.T).abs() <= float32_error(x.double(), w, 64)).all()


LOGPROB_TOL = 0.3  # nats: the kernel's int8 activations against float32 ones, through this model's 9 linears


def assert_close_greedy(ref, got, tol: float) -> None:
    """vLLM's check for outputs that may differ by near ties: the logprob of each shared greedy token within tol of
    the reference's, and at the first difference the two tokens within 2 tol of each other in the reference."""
    for j, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        here = ref.logprobs[j].top
        if a != b:
            assert b in here and here[a] - here[b] <= 2 * tol, (j, a, b, here)
            return
        assert abs(ref.logprobs[j].logprob - got.logprobs[j].logprob) <= tol, (j, ref.logprobs[j], got.logprobs[j])


@QUANT_KERNEL
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_a_gguf_loaded_packed_decodes_as_loaded_dequantized(tmp_path, qtype):
    """The same file, dequantized to float32 (quantization unset) and kept packed. The portable path multiplies the
    same float32 weights: identical greedy tokens. The kernel quantizes activations to int8 (the per-linear bound
    above): logprobs within LOGPROB_TOL, greedy tokens identical but for near ties."""
    from twospeed import LLM, SamplingParams

    # Q4_K needs inputs of 256: the file holds ffn_down in it, the rest in Q8_0, and runs as stored ("gguf")
    path, _ = gguf_file(tmp_path, lambda name: getattr(Q, qtype) if "ffn_down" in name or qtype != "Q4_K" else Q.Q8_0)
    quantization = "gguf" if qtype == "Q4_K" else FORMAT_OF[qtype]
    prompts = [[5, 9, 200, 31, 7, 77, 301, 12], [3, 44], list(range(260, 300))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    common = dict(dtype="float32", skip_tokenizer_init=True, cost_probe=False, max_num_batched_tokens=32)
    runs = {}
    for label, kw in (("dequantized", {}), ("portable", {"quantization": quantization, "linear_backend": "torch"}),
                      ("kernel", {"quantization": quantization})):
        llm = LLM(str(path), **common, **kw)
        runs[label] = llm.generate(prompts, params)
        assert all(m.fmt.use_kernel == (label == "kernel") for m in linears(llm.engine.model).values())
    for ref, portable, kernel in zip(runs["dequantized"], runs["portable"], runs["kernel"]):
        assert list(portable.token_ids) == list(ref.token_ids)
        assert [p.logprob for p in portable.logprobs] == [p.logprob for p in ref.logprobs]
        assert_close_greedy(ref, kernel, LOGPROB_TOL)


@QUANT_KERNEL
def test_auto_keeps_a_block_quantized_files_cache_in_bf16_packed_or_dequantized(tmp_path):
    """dtype auto computing a block-quantized GGUF in float32 keeps its KV cache in bf16, as a bf16 checkpoint's,
    whether the weights are kept packed or dequantized (so the portable path still decodes the dequantized load's
    tokens); a file of float32 matrices keeps the compute dtype's cache."""
    from twospeed import LLM, SamplingParams

    packed, _ = gguf_file(tmp_path, lambda name: Q.Q4_0)
    (tmp_path / "f32").mkdir()
    floats, _ = gguf_file(tmp_path / "f32", lambda name: Q.F32)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = []
    for path, kw, quantized in ((packed, {"quantization": "q4_0", "linear_backend": "torch"}, True),
                                (packed, {}, True), (floats, {}, False)):
        llm = LLM(str(path), skip_tokenizer_init=True, cost_probe=False, **kw)
        half = quantized and llm.engine.dtype == torch.float32
        assert llm.engine.memory().kv_cache_dtype == ("bf16" if half else "auto")
        assert llm.engine.runner.kv_cache.dtype == (torch.bfloat16 if half else llm.engine.dtype)
        tokens.append(list(llm.generate([[5, 9, 200, 31]], params)[0].token_ids))
    assert tokens[0] == tokens[1]


def test_loader_reads_blocks_only_for_linears_that_take_them(tmp_path):
    """A tied Q8_0 embedding feeds the embedding table floats and the output head its bytes."""
    path, written = gguf_file(tmp_path, lambda name: Q.Q8_0, tie=True)
    model = load_model(path, torch.float32, quantization="q8_0", linear_backend="torch")
    emb = torch.from_numpy(np.ascontiguousarray(written["token_embd.weight"][1]))
    assert torch.equal(model.lm_head.parts[0].data, emb)
    assert torch.equal(model.embed_tokens.weight, KINDS["Q8_0"].dequantize(emb, model.cfg.hidden_size))
