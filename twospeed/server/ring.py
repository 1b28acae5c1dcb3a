"""ColumnRing: a fixed-size ring of records stored column by column in preallocated float arrays.

The dashboard's history keeps every engine step and every inter-token gap of the last minutes. Python objects
per record (a tuple of boxed floats is ~200 bytes for ten fields) would make that memory depend on the step
rate; here it is exactly capacity x (columns + 1) x 8 bytes, allocated once. Each record carries a stamp
(monotonic seconds, non-decreasing in append order), so `since(t)` is a binary search. Missing values are NaN.
Not thread-safe on its own: the history holds a lock around it.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right

NAN = math.nan


class ColumnRing:
    def __init__(self, columns: tuple[str, ...], capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.columns = columns
        self.capacity = capacity
        self._stamps = array("d", bytes(8 * capacity))
        self._data = [array("d", bytes(8 * capacity)) for _ in columns]
        self.appended = 0  # records ever appended; the oldest kept is appended - len(self)

    def __len__(self) -> int:
        return min(self.appended, self.capacity)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (fixed at construction)."""
        return 8 * self.capacity * (len(self.columns) + 1)

    def append(self, stamp: float, values) -> None:
        """One record: `values` in column order (None becomes NaN). Stamps must not decrease."""
        i = self.appended % self.capacity
        self._stamps[i] = stamp
        for column, v in zip(self._data, values):
            column[i] = NAN if v is None else v
        self.appended += 1

    def _stamp(self, logical: int) -> float:
        return self._stamps[logical % self.capacity]

    def since(self, stamp: float) -> tuple[list[float], list[list[float]]]:
        """Stamps and columns of the records stamped after `stamp`, oldest first."""
        lo = self.appended - len(self)
        first = bisect_right(range(lo, self.appended), stamp, key=self._stamp) + lo
        return self._slice(self._stamps, first), [self._slice(c, first) for c in self._data]

    def _slice(self, arr: array, first: int) -> list[float]:
        a, b = first % self.capacity, self.appended % self.capacity
        if first >= self.appended:
            return []
        if a < b:
            return arr[a:b].tolist()
        return arr[a:].tolist() + arr[:b].tolist()
