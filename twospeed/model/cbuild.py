"""Build the CPU kernels in model/csrc/ on first use and load them with ctypes.

Each kernel is one C file compiled with the system C compiler (`CC`, else `cc`) for this CPU (-march=native)
into the twospeed cache folder, keyed by the source, compiler, flags and CPU, so a library built elsewhere
(a shared cache folder) is never loaded here.

Two ways a kernel can be missing, kept apart:
- unsupported here: no C compiler, a compiler that cannot build an OpenMP shared library for this CPU (a
  trivial probe file fails with our flags), or a CPU (or compiler) without the instructions the kernel is
  written for. A kernel states what it needs with a guard at its top that the compiler evaluates for
  -march=native: `#error "twospeed-unsupported: needs ..."`; the verdict is kept beside where the library would
  be, so later processes skip the compile. `build_library` returns None, logs why, and
  `unsupported_reason(name)` says it (the tests skip with that reason); the caller keeps its portable path.
- failed: the probe builds and the guard passes, yet the kernel does not compile or load. That is a bug in the
  source, not a property of the machine: `KernelBuildError` with the compiler's message (remembered per
  source, so a broken kernel is compiled once per process, not once per call).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from twospeed.config import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -Wfatal-errors: a kernel's guard stops the compile at once (else gcc goes on through the whole file). Not
# -ffast-math: linking with it sets flush-to-zero for the whole process (crtfastmath). Reassociation alone lets
# the dot products vectorize; infinities stay (the online softmax starts from -inf).
FLAGS = ["-O3", "-march=native", "-Wfatal-errors", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
UNSUPPORTED_MARK = "twospeed-unsupported:"  # the text of a kernel's `#error` guard: this CPU lacks what it needs
TIMEOUT_S = 600  # one compile; generous, so a busy machine does not turn a slow build into an error
_PROBE = "int twospeed_probe(void) {\n  int s = 0;\n#pragma omp parallel for reduction(+:s)\n" \
         "  for (int i = 0; i < 4; i++) s += i;\n  return s;\n}\n"

_unsupported: dict[str, str] = {}  # kernel name -> why it is unsupported here (the last attempt)
_failed: dict[Path, KernelBuildError] = {}  # library path (keyed by source) -> its build error
_toolchain: dict[str, str | None] = {}  # compiler -> None if the probe builds and loads, else why not


class KernelBuildError(RuntimeError):
    """A kernel failed to compile or load on a machine whose compiler and CPU support it."""


def cpu_id() -> str:
    """The CPU's model and feature flags (Linux), else what platform knows: what a build or a measurement
    made for this CPU is keyed by (a VM can hide AMX under the same model name)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return " ".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile(cc: str, source: Path, out: Path) -> str | None:
    """Compile `source` into the shared library `out`; None on success, else the compiler's message."""
    try:
        subprocess.run([cc, *FLAGS, str(source), "-o", str(out), "-lm"], check=True, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
        return None
    except subprocess.CalledProcessError as e:
        return (e.stderr or e.stdout or f"exit status {e.returncode}").strip()
    except (OSError, subprocess.SubprocessError) as e:  # not runnable, or timed out
        return str(e)


def _toolchain_problem(cc: str) -> str | None:
    """None if `cc` builds and loads an OpenMP shared library for this CPU with FLAGS, else why not."""
    if cc not in _toolchain:
        with tempfile.TemporaryDirectory() as tmp:
            src, lib = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
            src.write_text(_PROBE)
            err = _compile(cc, src, lib)
            if err is None:
                try:
                    ctypes.CDLL(str(lib))
                except OSError as e:
                    err = str(e)
        _toolchain[cc] = err
    return _toolchain[cc]


def _unsupported_here(name: str, reason: str) -> None:
    _unsupported[name] = reason
    log.warning("kernel %s unsupported here (%s): using the portable torch path", name, reason)


def unsupported_reason(name: str) -> str | None:
    """Why the last build_library(name) returned None (None if it did not)."""
    return _unsupported.get(name)


def build_library(name: str) -> ctypes.CDLL | None:
    """Build (once per source, compiler, flags and CPU) and load csrc/<name>.c. None where it is unsupported
    here; KernelBuildError where it should build and does not."""
    source = CSRC / f"{name}.c"
    cc = find_compiler()
    if cc is None:
        _unsupported_here(name, "no C compiler: CC is unset and there is no cc or gcc on PATH")
        return None
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # headers it may include
    key = hashlib.sha256(text + " ".join([cc, *FLAGS, cpu_id()]).encode()).hexdigest()[:16]
    lib = cache_root() / "kernels" / f"{name}-{key}.so"
    if lib in _failed:
        raise _failed[lib]
    verdict = lib.with_suffix(".unsupported")  # this CPU lacks what the source needs: known without a compile
    if not lib.exists():
        if verdict.exists():
            _unsupported_here(name, verdict.read_text())
            return None
        problem = _toolchain_problem(cc)
        if problem is not None:
            _unsupported_here(name, f"{cc} cannot build an OpenMP shared library for this CPU: {problem}")
            return None
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            err = _compile(cc, source, out)
            if err is not None and UNSUPPORTED_MARK in err:
                need = err.split(UNSUPPORTED_MARK, 1)[1].splitlines()[0].strip().strip('"')
                reason = f"{need}, which {cc} -march=native does not enable on this CPU"
                (Path(tmp) / verdict.name).write_text(reason)
                os.replace(Path(tmp) / verdict.name, verdict)
                _unsupported_here(name, reason)
                return None
            if err is not None:
                _failed[lib] = KernelBuildError(f"csrc/{name}.c failed to compile with {cc} on a machine that "
                                                f"supports it:\n{err}")
                raise _failed[lib]
            os.replace(out, lib)  # atomic: concurrent builders each publish a complete file
    try:
        loaded = ctypes.CDLL(str(lib))
    except OSError as e:
        _failed[lib] = KernelBuildError(f"csrc/{name}.c built into {lib.name} but does not load: {e}")
        raise _failed[lib] from e
    _unsupported.pop(name, None)
    return loaded


def load_library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """build_library(name) with each function's argument types set (they all return void)."""
    lib = build_library(name)
    if lib is None:
        return None
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = None
    return lib
