"""Publishing a checkpoint folder that is built on first use (the demo and task models), safely.

Files are written into a temp folder beside the target, then one rename publishes them, so a reader (or a
second builder racing this one) never sees a half-written folder; a builder that loses the race keeps the
winner's folder. A file lock beside the target lets a second process wait for a build under way instead of
repeating it (a trained model takes minutes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def publish_checkpoint(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` to fill a temp folder, then publish it at `path` atomically; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes 0600; a shared cache must be readable
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, path)  # atomic; also succeeds onto an empty folder
        except OSError:
            if not (path / "config.json").is_file():
                raise FileExistsError(f"{path} exists and is not a checkpoint") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


@contextlib.contextmanager
def build_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `<path>.lock` (POSIX flock; a no-op where there is none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: racing builders both build, and the rename keeps one
        yield
        return
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
