"""The dtype a task model trains in on this CPU (builtin/task_model.py): measured, once per machine.

Why: a CPU flag does not say which is faster. bf16 autocast halves a matmul's bytes and, with AMX or a
full-width AVX-512 BF16 unit, its time (a 1,000-step build: ~109 s in bf16 on a Zen 5). But on a Xeon that
exposes AVX-512 BF16 without AMX, oneDNN's bf16 product of a training step's shape ran at about half float32's
speed ([1536 x 428] x [428 x 2048], 2 threads, best of 7: 16.8 against 9.7 ms) and a whole step 1.45x
slower (0.58 against 0.40 s). Without bf16 instructions bf16 is a scalar fallback (model/compute_dtype.py).
So the trainer times the step's largest product both ways and trains in bf16 only where it clearly wins.

The answer is written to the cache folder under the CPU (model and flags), torch's version and the thread count: a
machine decides once, and a build's weights, which depend on the choice (builtin/task_model.spec_key), are the
same from one run to the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from twospeed.builtin.publish import build_lock
from twospeed.config import cache_root
from twospeed.model.cbuild import cpu_id
from twospeed.model.compute_dtype import cpu_computes

WIN = 0.8  # bf16 must take at most this share of float32's time (a near tie stays in float32: more exact)
SHAPE = (1536, 428, 2048)  # a step's MLP product: tokens x hidden x (gate + up)
RECORD = "train-dtype.json"


def train_in_bf16(threads: int, measure: Callable[[torch.dtype, int], float] | None = None) -> bool:
    """Whether a task model trains in bf16 autocast on this machine with `threads` threads: read from the
    cache folder, or measured (`measure(dtype, threads)` -> seconds, `product_time` by default) and recorded."""
    if not cpu_computes(torch.bfloat16):
        return False
    path, key = cache_root() / RECORD, machine_key(threads)
    record = _read(path)
    if key not in record:
        with build_lock(path):  # processes starting together measure once, and agree
            record = _read(path)
            if key not in record:
                timed = {str(dt).removeprefix("torch."): (measure or product_time)(dt, threads)
                         for dt in (torch.bfloat16, torch.float32)}
                record[key] = timed | {"bf16": timed["bfloat16"] <= WIN * timed["float32"]}
                _write(path, record)
    return bool(record[key]["bf16"])


def machine_key(threads: int) -> str:
    """What the choice depends on: the CPU (its model and flags, as kernel builds are keyed), torch's version
    (its oneDNN), the thread count."""
    cpu = hashlib.sha256(cpu_id().encode()).hexdigest()[:16]
    return f"cpu {cpu} | torch {torch.__version__} | {threads} threads"


def product_time(dtype: torch.dtype, threads: int, repeats: int = 7) -> float:
    """The fastest of `repeats` runs of SHAPE's product in `dtype` with `threads` threads, in seconds."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, k, n = SHAPE
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
        a @ b  # oneDNN builds its primitive on the first call
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(saved)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a reader sees the old record or the new one
