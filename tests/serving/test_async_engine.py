"""AsyncEngine without HTTP: bad input never reaches the step loop, a failing step fails only what was in
flight, aborts return every KV block, and the engine thread outlives all of it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from twospeed.config import EngineConfig
from twospeed.engine.engine import LLMEngine
from twospeed.engine.sampling_params import SamplingParams
from twospeed.serving.async_engine import AsyncEngine
from twospeed.serving.events import FinishEvent
from twospeed.serving.request_group import Admission, RequestGroup, SequenceSpec


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=32, max_model_len=128))


def group(*prompts, max_tokens=4, name="g") -> RequestGroup:
    specs = [SequenceSpec(f"{name}-{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0), i)
             for i, p in enumerate(prompts)]
    return RequestGroup(Admission("default", 0, time.monotonic(), specs))


async def finish(g: RequestGroup, timeout: float = 30.0) -> list:
    items = []
    while not g.done:
        items.append(await asyncio.wait_for(g.next(), timeout))
    return items


def idle(engine: LLMEngine) -> bool:
    return not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.num_blocks


async def until_idle(engine: LLMEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not idle(engine):
        assert time.monotonic() < deadline, "the engine did not return to idle"
        await asyncio.sleep(0.02)


def test_async_engine_survives_bad_input_failures_and_aborts(engine):
    finished = []

    async def main():
        def listener(event):
            if isinstance(event, FinishEvent):
                finished.append((event.request.request_id, event.aborted))

        ae = AsyncEngine(engine, listeners=[listener])
        ae.start()
        try:
            # Bad input: the whole group is refused, nothing stays in the engine.
            with pytest.raises(ValueError, match=r"\[0, 8192\)"):
                await ae.add(group([5, 6, 7], [10**6], name="bad"))
            await until_idle(engine)
            assert ae.is_alive

            # A normal request streams to completion.
            ok = group([5, 6, 7], name="ok")
            await ae.add(ok)
            items = await finish(ok)
            assert sum(len(i.delta.new_token_ids) for i in items) == 4 and items[-1].output.finished
            assert all(len(i.delta.token_times) == len(i.delta.new_token_ids) for i in items)

            # A step that raises fails the sequences in flight and nothing else.
            real_step = engine.step_deltas
            calls = {"n": 0}

            def flaky_step():
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("injected fault")
                return real_step()

            engine.step_deltas = flaky_step
            try:
                doomed = group([8, 9, 10], max_tokens=20, name="doomed")
                await ae.add(doomed)
                items = await finish(doomed)
                assert items[-1].error is not None and "injected fault" in str(items[-1].error)
            finally:
                engine.step_deltas = real_step
            assert ae.step_failures == 1 and ae.is_alive

            # An abort mid-generation returns every block.
            long = group([11, 12], max_tokens=100, name="long")
            await ae.add(long)
            first = await long.next()
            assert first.delta is not None
            ae.abort(long)
            items = await finish(long)
            assert items[-1].delta is None  # the abort marker
            await until_idle(engine)

            # And it still serves.
            again = group([5, 6, 7], name="again")
            await ae.add(again)
            assert (await finish(again))[-1].output.finished
        finally:
            await ae.shutdown()
        assert not ae.is_alive

    asyncio.run(main())
    assert ("ok-0", False) in finished and ("long-0", True) in finished and ("doomed-0", True) in finished
    assert idle(engine)


def test_a_groups_itl_target_reaches_its_requests(engine):
    """The lane's tightest ITL objective travels with every sequence of the group to the scheduler."""
    seen = []

    async def main():
        def listener(event):
            if isinstance(event, FinishEvent):
                seen.append(event.request.itl_target)

        ae = AsyncEngine(engine, listeners=[listener])
        ae.start()
        try:
            g = group([5, 6, 7], [8, 9], name="slo")
            g.admission.itl_target = 0.06
            await ae.add(g)
            await finish(g)
        finally:
            await ae.shutdown()

    asyncio.run(main())
    assert seen == [0.06, 0.06]
    with pytest.raises(ValueError, match="itl_target"):
        engine.add_request("bad-target", [5, 6], SamplingParams(max_tokens=2), itl_target=0.0)


def test_a_builder_runs_in_the_engine_thread_and_its_failure_reaches_ready():
    """The engine is built in the thread that steps it (one OpenMP pool: see async_engine's docstring)."""
    built_in = []

    def build():
        built_in.append(threading.current_thread())
        return LLMEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=32, max_model_len=128))

    def broken():
        raise ValueError("no such checkpoint")

    async def main():
        ae = AsyncEngine(build)
        assert ae.engine is None
        ae.start()
        try:
            engine = await ae.ready()
            assert built_in == [ae._thread] and ae.engine is engine
            g = group([5, 6, 7], name="built")
            await ae.add(g)
            assert (await finish(g))[-1].output.finished
        finally:
            await ae.shutdown()
        bad = AsyncEngine(broken)
        bad.start()
        with pytest.raises(ValueError, match="no such checkpoint"):
            await bad.ready()
        bad._thread.join(5)
        assert not bad.is_alive

    asyncio.run(main())
