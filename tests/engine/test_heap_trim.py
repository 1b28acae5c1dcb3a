"""engine/heap_trim.py: the trimmer runs at most once per interval, never when off; and the mechanism it relies on
holds on this C library: the pages of free holes inside the heap (which free() alone keeps resident, because a
live chunk above them pins the heap's top) go back to the OS on malloc_trim(0)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from twospeed.engine.heap_trim import HeapTrimmer, _glibc_trim


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_trims_at_most_once_per_interval():
    clock, calls = FakeClock(), []
    trimmer = HeapTrimmer(10.0, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    for t in (0.0, 5.0, 9.99):
        clock.t = t
        assert not trimmer.maybe_trim()
    clock.t = 10.0
    assert trimmer.maybe_trim() and calls == [0]
    clock.t = 19.0
    assert not trimmer.maybe_trim()
    clock.t = 20.5
    assert trimmer.maybe_trim() and trimmer.num_trims == 2


@pytest.mark.parametrize("interval", [None, 0, 0.0])
def test_off_never_trims(interval):
    clock, calls = FakeClock(), []
    trimmer = HeapTrimmer(interval, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    clock.t = 1e9
    assert not trimmer.maybe_trim() and not calls


FRAGMENT = r"""
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
size, n = 96 << 10, 2000  # below glibc's initial mmap threshold: from the heap
chunks = [libc.malloc(size) for _ in range(n)]
for c in chunks:
    libc.memset(c, 1, size)
full = rss_mb()
for c in chunks[:-1]:  # the last stays live: the heap's top cannot shrink past it
    libc.free(c)
freed = rss_mb()
libc.malloc_trim(0)
print(full, freed, rss_mb())
"""


@pytest.mark.skipif(_glibc_trim() is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_malloc_trim_returns_the_free_holes_pages():
    full, freed, trimmed = map(float, subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True,
                                                     text=True, check=True).stdout.split())
    # ~188 MB of holes: free() keeps them resident (the live chunk above pins the top), malloc_trim does not
    assert freed > full - 20, (full, freed)
    assert trimmed < freed - 150, (full, freed, trimmed)
