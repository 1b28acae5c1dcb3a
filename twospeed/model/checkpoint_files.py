"""Which kind of checkpoint a path is, without torch: the tokenizer (which the server's process loads without a
model) and the loader (model/loader.py) both ask here.

A Hugging Face folder holds config.json; a GGUF checkpoint is a .gguf file, or a folder holding exactly one
(and no config.json). Several .gguf files in one folder is an error that names them: which one was meant is
not guessed.
"""

from __future__ import annotations

from pathlib import Path

GGUF_SUFFIX = ".gguf"


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
