"""The thread governor: fewer threads exactly while other processes take cores, back when they go."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from twospeed.engine.threads import CONFIRM_WINDOWS, YIELD_AT, CpuSample, ThreadGovernor, read_sample


class FakeMachine:
    """A clock and /proc readings advanced by hand: `run(seconds, others=cores, own=cores)`."""

    def __init__(self):
        self.now = CpuSample(wall=100.0, machine_busy=1000.0, own=10.0)

    def run(self, seconds: float, others: float, own: float = 2.0) -> None:
        n = self.now
        self.now = CpuSample(n.wall + seconds, n.machine_busy + (others + own) * seconds, n.own + own * seconds)

    def __call__(self) -> CpuSample:
        return self.now


def governor(max_threads=2, interval=0.5, confirm=1):
    machine, calls = FakeMachine(), []
    return ThreadGovernor(max_threads, calls.append, interval=interval, confirm=confirm, sample=machine), machine, calls


@pytest.mark.parametrize("others,want", [(0.0, 2), (YIELD_AT - 0.01, 2), (YIELD_AT + 0.01, 1), (0.67, 1), (1.0, 1),
                                         (1.9, 1)])
def test_threads_follow_the_cores_others_take(others, want):
    gov, machine, calls = governor()
    machine.run(0.6, others)
    assert gov.tick() == want
    assert gov.others == pytest.approx(others)
    assert calls == ([] if want == 2 else [want])  # the setter runs only on a change


def test_four_cores_give_up_one_thread_per_busy_core():
    for others, want in ((0.0, 4), (0.5, 3), (1.2, 3), (1.5, 2), (2.9, 1), (3.8, 1)):
        gov, machine, _ = governor(max_threads=4)
        machine.run(1.0, others)
        assert gov.tick() == want, others


def test_back_to_all_threads_when_the_co_tenant_leaves_and_no_change_within_a_window():
    gov, machine, calls = governor()
    machine.run(0.6, 1.0)
    assert gov.tick() == 1
    machine.run(0.2, 0.0)  # inside the window: no new reading
    assert gov.tick() == 1
    machine.run(0.4, 0.0, own=1.0)  # a whole window alone (one thread busy)
    assert gov.tick() == 2
    assert calls == [1, 2] and gov.changes == 2


def test_a_passing_burst_changes_nothing_a_sustained_load_does():
    """With the default confirmation, one busy window (a client starting) keeps the threads; three in a row yield
    one, and three quiet ones in a row give it back."""
    gov, machine, calls = governor(confirm=CONFIRM_WINDOWS)
    assert CONFIRM_WINDOWS == 3
    for others, want in ((1.0, 2), (0.0, 2), (1.0, 2), (1.0, 2), (1.0, 1), (0.0, 1), (1.0, 1), (0.0, 1), (0.0, 1),
                         (0.0, 2)):
        machine.run(0.6, others)
        assert gov.tick() == want, (others, calls)
    assert calls == [1, 2] and gov.changes == 2


def test_own_threads_never_count_as_others():
    gov, machine, calls = governor()
    machine.run(0.6, 0.0, own=2.0)  # our two threads (and the HTTP loop) keep both cores busy
    assert gov.tick() == 2 and calls == []


def test_without_proc_or_with_one_thread_nothing_changes():
    calls = []
    gov = ThreadGovernor(2, calls.append, sample=lambda: None)
    assert gov.tick() == 2
    gov1, machine, calls1 = governor(max_threads=1)
    machine.run(1.0, 1.0)
    assert gov1.tick() == 1 and calls1 == []


def spinning_child() -> subprocess.Popen:
    """A process that keeps one core busy for up to 30 s."""
    return subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"])


@pytest.mark.skipif(read_sample() is None, reason="no /proc/stat here")
def test_a_real_busy_process_is_seen_as_others():
    """Against the real /proc: a spinning child process shows up as about one core of others' load."""
    gov = ThreadGovernor(os.cpu_count() or 1, lambda n: None, interval=0.0)
    child = spinning_child()
    try:
        time.sleep(1.0)  # let it start, then measure a window while it spins
        gov.tick()
        time.sleep(1.0)
        gov.tick()
    finally:
        child.kill()
        child.wait()
    assert 0.5 < gov.others < (os.cpu_count() or 1) + 0.5  # a loaded CI machine adds more, never less


@pytest.mark.skipif(read_sample() is None, reason="no /proc/stat here")
def test_a_process_counted_as_own_is_not_others():
    """The same spinning child, counted as this process's own (an engine process's server), leaves others' load:
    two governors over the same window, one counting it and one not, differ by about the core it spins on
    (whatever else the machine runs, a CI neighbour or a server still exiting, is in both)."""
    counting = ThreadGovernor(os.cpu_count() or 1, lambda n: None, interval=0.0)
    plain = ThreadGovernor(os.cpu_count() or 1, lambda n: None, interval=0.0)
    child = spinning_child()
    try:
        time.sleep(1.0)
        counting.count_as_own((child.pid,))
        plain.count_as_own(())
        time.sleep(1.0)
        counting.tick()
        plain.tick()
    finally:
        child.kill()
        child.wait()
    assert plain.others - counting.others > 0.5, (plain.others, counting.others)


class _FixedGovernor:
    """A governor whose thread count the test sets (the engine asks it once a step)."""

    def __init__(self, max_threads: int):
        self.max_threads = self.threads = max_threads

    def tick(self) -> int:
        return self.threads


def test_each_thread_count_has_its_own_step_cost_fit():
    """Steps on one thread of two must not teach the two-thread fit (it would mispredict both): a count first
    seen starts from the top count's coefficients scaled by the thread ratio, learns alone, and the top count's
    fit comes back untouched when the governor returns to it."""
    from twospeed.config import EngineConfig
    from twospeed.engine.cost_model import LinearCostModel
    from twospeed.engine.engine import LLMEngine
    from twospeed.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=32, max_model_len=128, num_threads=1,
                                                adapt_threads=False))
    engine.threads = governor = _FixedGovernor(2)
    engine._cost_models, engine._cost_threads = {2: engine.cost_model}, 2  # as built with a two-thread ceiling
    top = engine.cost_model
    before = dict(top.coefficients)

    def run(n: int) -> None:
        engine.add_request(f"r{n}", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()

    governor.threads = 1
    run(0)
    one = engine.cost_model
    assert one is not top and engine.scheduler.cost_model is one and one.key == top.key
    assert one.num_observed > 0 and top.coefficients == before  # the one-thread steps taught only their own fit
    governor.threads = 2
    run(1)
    assert engine.cost_model is top and engine.scheduler.cost_model is top and top.num_observed > 0
    governor.threads = 1
    engine.step()
    assert engine.cost_model is one  # the same fit again, not a fresh one
    stand_in = LinearCostModel(list(top.coefficients.values()))  # as plan/calibrate.py's recorder stands in
    engine.cost_model = engine.scheduler.cost_model = stand_in
    governor.threads = 2
    engine.step()
    assert engine.cost_model is stand_in and engine.scheduler.cost_model is stand_in


def test_a_new_thread_count_starts_from_the_scaled_top_fit():
    from twospeed.config import EngineConfig
    from twospeed.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=32, max_model_len=128, num_threads=1,
                                                adapt_threads=False))
    engine.threads = governor = _FixedGovernor(4)
    engine._cost_models, engine._cost_threads = {4: engine.cost_model}, 4
    top = dict(engine.cost_model.coefficients)
    governor.threads = 2
    engine.step()  # nothing to run: only the model is picked
    assert engine.cost_model.coefficients == pytest.approx({k: 2 * v for k, v in top.items()})
