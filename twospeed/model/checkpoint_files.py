"""Which kind of checkpoint a path is, without torch: the tokenizer (which the server's process loads without a
model) and the loader (model/loader.py) both ask here.

A Hugging Face folder holds config.json; a GGUF checkpoint is a .gguf file, or a folder holding exactly one
(and no config.json). Several .gguf files in one folder is an error that names them: which one was meant is
not guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
_readers: dict[tuple, Any] = {}  # the last GGUF file parsed: (path, size, mtime) -> its reader


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names or holds, or None when it is not a GGUF checkpoint."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        raise CheckpointError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                              "name the one to load")
    return found[0] if found else None


def is_checkpoint_path(path: str | Path) -> bool:
    """A folder (any: the loader names what it lacks) or a .gguf file."""
    path = Path(path)
    return path.is_dir() or (path.is_file() and path.suffix.lower() == GGUF_SUFFIX)


def gguf_reader(path: str | Path) -> Any:
    """The file's `gguf.GGUFReader`, kept for the next caller: parsing a vocabulary's metadata takes seconds, and
    the engine reads the config, the tokenizer and the weights of one file in turn (`release_gguf_reader` after)."""
    from gguf import GGUFReader

    path = Path(path).resolve()
    stat = path.stat()
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _readers:
        try:
            reader = GGUFReader(path)
        except Exception as e:  # a truncated or foreign file: the package's message names no file
            raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
        _readers.clear()
        _readers[key] = reader
    return _readers[key]


def release_gguf_reader(path: str | Path) -> None:
    """Forget the kept reader of `path` (its weights are loaded)."""
    path = Path(path).resolve()
    for key in [k for k in _readers if k[0] == path]:
        del _readers[key]
