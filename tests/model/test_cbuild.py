"""Kernel builds: "unsupported here" skips with its reason, a kernel that should build and does not is an error,
and on a CPU with AVX-512 BF16 every fast path actually loads (so its tests run rather than skip).

The classification is checked on this machine by changing what it is told: no compiler on PATH, a "compiler"
that cannot build anything, an older -march target without AVX-512, and a kernel source with a syntax error.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch

from twospeed.model import cbuild

KERNELS = ("paged_attention", "attention_bf16", "fused_bf16", "linear_bf16")
BF16_KERNELS = KERNELS[1:]


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {f for ln in lines if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}


HAS_AVX512_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache and no remembered probe or failure, so build_library really compiles."""
    monkeypatch.setenv("TWOSPEED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild, "_toolchain", {})
    monkeypatch.setattr(cbuild, "_failed", {})
    monkeypatch.setattr(cbuild, "_unsupported", {})
    return tmp_path


def copy_csrc(tmp_path: Path, monkeypatch) -> Path:
    csrc = tmp_path / "csrc"
    shutil.copytree(cbuild.CSRC, csrc)
    monkeypatch.setattr(cbuild, "CSRC", csrc)
    return csrc


needs_compiler = pytest.mark.skipif(cbuild.find_compiler() is None, reason="no C compiler on this machine")


@needs_compiler
@pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16 (avx512_bf16, avx512bw, avx512vl)")
def test_every_fast_path_loads_on_a_cpu_with_avx512_bf16():
    from twospeed.model.cpu_attention import CpuPagedAttention, load_bf16_kernel, load_kernel, make_attention
    from twospeed.model.fused_ops import _kernel_for, fused_kernel
    from twospeed.model.packed_linear import linear_kernel, resolve_linear_backend

    for name, loader in zip(KERNELS, (load_kernel, load_bf16_kernel, fused_kernel, linear_kernel)):
        assert loader() is not None, f"{name}: {cbuild.unsupported_reason(name)}"
    # and what `auto` picks is the fast path
    assert resolve_linear_backend("auto", "cpu", torch.bfloat16) == "cpu"
    attn = make_attention("auto", 8, 2, 64, None, "cpu", torch.bfloat16)
    assert isinstance(attn, CpuPagedAttention) and attn.bf16_kernel is not None and attn.prefill_kernel is not None
    assert _kernel_for(torch.zeros(2, 8, dtype=torch.bfloat16)) is not None


@needs_compiler
def test_the_portable_kernel_loads_wherever_the_compiler_works():
    from twospeed.model.cpu_attention import load_kernel

    problem = cbuild._toolchain_problem(cbuild.find_compiler())
    if problem is not None:
        pytest.skip(f"the compiler cannot build an OpenMP library here: {problem}")
    assert load_kernel() is not None, cbuild.unsupported_reason("paged_attention")


def test_no_compiler_is_unsupported_with_that_reason(fresh, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(fresh))  # nothing to run there
    assert cbuild.build_library("fused_bf16") is None
    assert "no C compiler" in cbuild.unsupported_reason("fused_bf16")


@needs_compiler
def test_a_compiler_that_cannot_build_is_unsupported(fresh, monkeypatch):
    monkeypatch.setenv("CC", "false")  # runs, builds nothing
    assert cbuild.build_library("paged_attention") is None
    assert "false cannot build an OpenMP shared library" in cbuild.unsupported_reason("paged_attention")


@needs_compiler
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only: an AVX2 target stands in")
def test_a_cpu_without_the_instructions_is_unsupported_and_the_portable_kernel_still_builds(fresh, monkeypatch):
    """-march=x86-64-v3 (AVX2, no AVX-512) stands in for an older CPU: each AVX-512 BF16 kernel's guard fires,
    and the portable C kernel builds all the same."""
    monkeypatch.setattr(cbuild, "FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in cbuild.FLAGS])
    for name in BF16_KERNELS:
        assert cbuild.build_library(name) is None
        assert cbuild.unsupported_reason(name).startswith("needs AVX-512 BF16"), cbuild.unsupported_reason(name)
    assert cbuild.build_library("paged_attention") is not None
    assert cbuild.unsupported_reason("paged_attention") is None
    # a later process (nothing remembered in memory) reads the verdict from the cache instead of compiling again
    monkeypatch.setattr(cbuild, "_unsupported", {})
    calls = []
    monkeypatch.setattr(cbuild, "_compile", lambda *a: calls.append(a))
    assert cbuild.build_library(BF16_KERNELS[0]) is None and calls == []
    assert cbuild.unsupported_reason(BF16_KERNELS[0]).startswith("needs AVX-512 BF16")


@needs_compiler
def test_a_kernel_that_fails_to_compile_is_an_error_naming_the_compiler_message(fresh, monkeypatch):
    if cbuild._toolchain_problem(cbuild.find_compiler()) is not None:
        pytest.skip("the compiler cannot build an OpenMP library here")
    csrc = copy_csrc(fresh, monkeypatch)
    source = csrc / "paged_attention.c"
    source.write_text(source.read_text().replace("int paged_attention_limits(", "int paged_attention_limits(((", 1))
    with pytest.raises(cbuild.KernelBuildError, match=r"csrc/paged_attention\.c failed to compile") as err:
        cbuild.build_library("paged_attention")
    assert "error" in str(err.value) and "paged_attention.c:" in str(err.value)  # the compiler's own diagnostic
    calls = []
    monkeypatch.setattr(cbuild, "_compile", lambda *a: calls.append(a))
    with pytest.raises(cbuild.KernelBuildError):  # remembered: not compiled again on every call
        cbuild.build_library("paged_attention")
    assert calls == []


@needs_compiler
@pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16: the kernel would be unsupported")
def test_a_broken_avx512_kernel_fails_rather_than_skips_on_a_cpu_that_has_the_instructions(fresh, monkeypatch):
    csrc = copy_csrc(fresh, monkeypatch)
    source = csrc / "fused_bf16.c"
    source.write_text(source.read_text() + "\nint broken(void) { return }\n")
    with pytest.raises(cbuild.KernelBuildError, match=r"csrc/fused_bf16\.c failed to compile"):
        cbuild.build_library("fused_bf16")
    assert cbuild.unsupported_reason("fused_bf16") is None
