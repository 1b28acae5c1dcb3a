"""Step with as many threads as the cores other processes leave free.

Why: a step's work is split across OpenMP threads (torch's ops and the C kernels) that meet at a barrier
after every parallel region. When another process takes one of the cores, the thread on it is descheduled
and its peers spin at the next barrier until it runs again, a scheduler tick later. On two cores with one
CPU-bound co-tenant, a served batch-1 decode fell from 130 to 2.5 tok/s that way (BENCHMARKS.md). A team of
threads no larger than the free cores never waits for a descheduled peer; with a passive wait policy instead,
every region would pay a futex wake-up even on idle cores.

`ThreadGovernor` samples, at most every `interval` seconds, the CPU time the whole machine spent busy
(/proc/stat) minus this process's own (all of its threads: the engine, the HTTP loop, the tokenizer pool),
which is what other processes took, in cores. It sets the thread count to the cores they leave free (at least
one, at most the configured count) and raises it again when they go, but only once the same count has been
wanted for `confirm` windows in a row: a change of thread count is not free (oneDNN's primitives, AMX tile
configurations and the OpenMP team are rebuilt for the new count; a prefill that straddled a change took 15x
its time on an AMX CPU), so a passing burst (a client starting, a compiler) must not flip it. Without /proc
(not Linux) it keeps the configured count. No torch here: the thread setter is passed in, so tests drive the rule with fake readings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

# Other processes' load (in cores) at which one of our threads gives its core up: a co-tenant that keeps a
# core busy half of the time already makes the thread on that core miss most barriers.
YIELD_AT = 0.5
CONFIRM_WINDOWS = 3  # windows in a row that must want the same new count before it is set
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpu columns: user nice system irq softirq steal (not idle, iowait)


@dataclass(slots=True)
class CpuSample:
    wall: float  # seconds, monotonic
    machine_busy: float  # CPU seconds all cores spent busy since boot
    own: float  # CPU seconds this process used since it started


def read_sample(family: tuple[int, ...] = ()) -> CpuSample | None:
    """The machine's busy time and this process's CPU time now (plus that of the `family` processes: an engine
    process counts its server's as its own); None where /proc/stat is not readable."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields)) / hz
    t = os.times()
    return CpuSample(time.monotonic(), busy, t.user + t.system + sum(process_cpu(pid, hz) for pid in family))


def process_cpu(pid: int, hz: int) -> float:
    """CPU seconds (user + system) process `pid` has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": state is fields[0], utime fields[11]
    return (int(fields[11]) + int(fields[12])) / hz


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadGovernor:
    """Called once per engine step; changes the step's thread count only when other processes' load moved."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], *, interval: float = 0.5,
                 confirm: int = CONFIRM_WINDOWS, sample: Callable[[], CpuSample | None] = read_sample):
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.others = 0.0  # cores other processes used over the last window
        self._set, self._sample, self.interval = set_threads, sample, interval
        self._last = sample()
        self.changes = 0
        self.confirm = max(1, confirm)
        self._pending, self._seen = self.max_threads, 0  # the count the last windows wanted, and for how many

    def count_as_own(self, pids: tuple[int, ...]) -> None:
        """Count these processes' CPU time as this one's (an engine process's server: its HTTP work is the
        service's own, as it was when both ran in one process). Only for the default /proc sampler."""
        self._sample = partial(read_sample, pids)
        self._last = self._sample()

    def tick(self) -> int:
        """Re-read the load if a window has passed; returns the thread count the next step should use."""
        if self._last is None or self.max_threads == 1:
            return self.threads
        now = self._sample()
        if now is None or now.wall - self._last.wall < self.interval:
            return self.threads
        wall = now.wall - self._last.wall
        self.others = max(0.0, (now.machine_busy - self._last.machine_busy) - (now.own - self._last.own)) / wall
        self._last = now
        # each whole core of others' load, and a part of one from YIELD_AT up, costs one thread
        want = max(1, self.max_threads - int(self.others + (1 - YIELD_AT)))
        self._seen = self._seen + 1 if want == self._pending else 1
        self._pending = want
        if want != self.threads and self._seen >= self.confirm:
            self.threads = want
            self.changes += 1
            self._set(want)
        return self.threads
