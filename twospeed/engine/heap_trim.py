"""Give the C heap's free pages back to the OS now and then, so the engine's RSS follows its live memory.

A step's activations are a few large buffers whose sizes follow the step's row count, which changes with every
prompt length and chunk. glibc serves such buffers from its heap once its mmap threshold has risen past them
(it rises after the first large free), and freed holes of one size rarely fit the next size asked for: the
heap fragments, and the pages of its free holes stay resident. Over thousands of distinct prompts RSS climbs
while live memory does not (BENCHMARKS.md: the engine's memory across distinct prompts). `malloc_trim(0)`
returns every whole free page inside the heap (madvise), not only its top; it costs milliseconds, so it
runs at most once per `interval_s` of steps, at the end of a step. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Calls malloc_trim(0) when `interval_s` has passed since the last call (None or 0: never)."""

    def __init__(self, interval_s: float | None, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None):
        self.interval_s = interval_s
        self.clock = clock
        self.trim = trim if trim is not None else _glibc_trim() if interval_s else None
        self.last = clock()
        self.num_trims = 0
        self.trim_time_s = 0.0  # spent in malloc_trim so far: its cost, to report beside what it saved

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed; True if it did."""
        now = self.clock()
        if self.trim is None or not self.interval_s or now - self.last < self.interval_s:
            return False
        self.trim(0)
        self.last = self.clock()
        self.num_trims += 1
        self.trim_time_s += self.last - now
        return True
