"""Build the CPU kernels in model/csrc/ on first use and load them with ctypes.

Each kernel is one C file compiled with the system C compiler (`CC`, else `cc`) for this CPU (-march=native)
into the twospeed cache folder, keyed by the source, compiler, flags and CPU, so a library built elsewhere
(a shared cache folder) is never loaded here. Where there is no compiler, or the build fails (an old compiler,
or a CPU without the instructions the kernel is written for), `build_library` returns None and the caller keeps
its portable path.
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
# Not -ffast-math: linking with it sets flush-to-zero for the whole process (crtfastmath). Reassociation
# alone lets the dot products vectorize; infinities stay (the online softmax starts from -inf).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
         "-fopenmp", "-shared", "-fPIC"]


def _cpu_id() -> str:
    """The CPU's model and feature flags (Linux), else what platform knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return " ".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def build_library(name: str) -> ctypes.CDLL | None:
    """Build (once per source, compiler, flags and CPU) and load csrc/<name>.c; None where it cannot be."""
    source = CSRC / f"{name}.c"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: %s uses the portable torch path", name)
        return None
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # headers it may include
    key = hashlib.sha256(text + " ".join([cc, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    lib = cache_root() / "kernels" / f"{name}-{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                subprocess.run([cc, *FLAGS, str(source), "-o", str(out), "-lm"], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(out, lib)  # atomic: concurrent builders each publish a complete file
        return ctypes.CDLL(str(lib))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("kernel %s unavailable (%s): using the portable torch path", name, detail)
        return None


def load_library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """build_library(name) with each function's argument types set (they all return void)."""
    lib = build_library(name)
    if lib is None:
        return None
    for fn, argtypes in signatures.items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = None
    return lib
