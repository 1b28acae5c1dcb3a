"""ProcessEngine: the engine stepped in a process of its own gives exactly what the engine in this process gives
(greedy tokens, the clock's stamps, the bill, the SLO verdict), refuses bad input with the field named and keeps
serving, returns every KV block on abort, ends open streams with an error when its process dies, and its
process exits when the server's does."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest

from twospeed.config import EngineConfig
from twospeed.engine.engine import LLMEngine
from twospeed.engine.sampling_params import SamplingParams, StructuredOutput
from twospeed.serving.process_engine import ProcessEngine
from twospeed.serving.process_messages import Outbox
from twospeed.serving.events import FinishEvent, LoadEvent, StepEvent
from twospeed.serving.request_group import Admission, EngineError, EngineGone, RequestGroup, SequenceSpec
from twospeed.schema.slo import SLOTable, parse_slo_flag

CONFIG = EngineConfig.from_kwargs("demo", num_gpu_blocks=32, max_model_len=128, num_threads=1)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 20]]


def group(*prompts, max_tokens=6, name="g", lane="default") -> RequestGroup:
    specs = [SequenceSpec(f"{name}-{i}", list(p), SamplingParams(max_tokens=max_tokens, temperature=0), i)
             for i, p in enumerate(prompts)]
    return RequestGroup(Admission(lane, 0, time.monotonic(), specs))


async def finish(g: RequestGroup, timeout: float = 60.0) -> list:
    items = []
    while not g.done:
        items.append(await asyncio.wait_for(g.next(), timeout))
    return items


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_the_engine_process_matches_the_engine_here_and_survives_bad_input():
    reference = LLMEngine(CONFIG)
    expected = {}
    for i, p in enumerate(PROMPTS):
        reference.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0))
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                expected[out.request_id] = out.token_ids
    slos = SLOTable([parse_slo_flag("chat:ttft_p99=60s")])
    events = []

    async def main():
        pe = ProcessEngine(CONFIG, judge=lambda lane, req: slos.judge(lane, req.clock, req.bill, req.num_preemptions),
                           listeners=[events.append])
        pe.start()
        try:
            view = await pe.ready()
            assert view.num_blocks == reference.num_blocks and view.max_model_len == 128
            assert view.tokenizer.encode("hello") == reference.tokenizer.encode("hello")
            started = view.cost_model.num_observed  # the start-up probe's steps
            # bad input: refused whole with its field named, nothing left in the engine
            with pytest.raises(ValueError, match="max_model_len|room|exceed") as err:
                await pe.add(group([1] * 200, max_tokens=4, name="long"))
            assert getattr(err.value, "param", None) is not None
            # a grammar is compiled once, in the engine process: one that does not compile is refused with its
            # field, one that does is followed (the server side never builds a compiler of its own)
            bad = group([5, 6, 7], name="bad-grammar")
            bad.specs[0].params = SamplingParams(max_tokens=4, structured=StructuredOutput(regex="(unclosed"))
            with pytest.raises(ValueError) as err:
                await pe.add(bad)
            assert err.value.param == "structured"
            choice = group([5, 6, 7], name="choice")
            choice.specs[0].params = SamplingParams(max_tokens=8, temperature=0,
                                                    structured=StructuredOutput(choice=["yes", "no"]))
            await pe.add(choice)
            done = [it for it in await finish(choice) if it.finished][-1].output
            assert view.tokenizer.decode(done.token_ids) in ("yes", "no")
            assert not hasattr(view, "grammars")
            g = group(*PROMPTS, lane="chat")
            await pe.add(g)
            items = await finish(g)
            last = {it.request_id: it for it in items if it.finished}
            for i in range(len(PROMPTS)):
                out = last[f"g-{i}"].output
                assert out.token_ids == expected[f"r{i}"], i
                assert out.bill.prompt_tokens == len(PROMPTS[i]) and out.bill.output_tokens == 6
                clock = out.clock
                assert clock.arrival <= clock.first_scheduled <= clock.first_token <= clock.finished <= time.monotonic()
                assert len(clock.token_times) == 6 and last[f"g-{i}"].verdict.met
            streamed = {}
            for it in items:  # the items' tokens add up to the whole output, stamped in this process's clock
                streamed.setdefault(it.request_id, []).extend(it.delta.new_token_ids)
            assert streamed == {rid: it.output.token_ids for rid, it in last.items()}
            await until(lambda: pe.num_running == 0 and pe.num_waiting == 0)
            # the engine's cost model reaches this side: seeded by its probe at ready, refreshed once it goes idle
            await until(lambda: view.cost_model.num_observed >= started + 6)
            assert view.cost_model.key == reference.cost_model.key
            assert set(view.cost_model.coefficients) == set(reference.cost_model.coefficients)
        finally:
            await pe.shutdown()
        assert not pe.is_alive and pe._proc.returncode == 0

    asyncio.run(main())
    finishes = [e for e in events if isinstance(e, FinishEvent) and e.lane == "chat"]
    assert sorted(e.request.request_id for e in finishes) == ["g-0", "g-1", "g-2"]
    assert all(e.verdict is not None and e.verdict.met and e.counts()["output_tokens"] == 6 for e in finishes)
    assert any(isinstance(e, StepEvent) for e in events)
    assert isinstance([e for e in events if isinstance(e, LoadEvent)][-1], LoadEvent)


def test_an_abort_returns_every_block_and_a_dead_engine_ends_its_streams():
    loads = []

    async def main():
        pe = ProcessEngine(CONFIG, listeners=[lambda e: isinstance(e, LoadEvent) and loads.append(e)], nice=3)
        pe.start()
        try:
            await pe.ready()
            # ServerConfig.engine_nice: the engine process runs that much nicer than the server's
            assert os.getpriority(os.PRIO_PROCESS, pe.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
            g = group([5, 6, 7], max_tokens=100, name="long")
            await pe.add(g)
            first = await asyncio.wait_for(g.next(), 60)
            assert first.delta is not None and not first.finished
            pe.abort(g)
            items = await finish(g)
            assert items[-1].delta is None  # aborted
            await until(lambda: loads and loads[-1].kv_usage == 0.0 and pe.num_running == 0)
            # the engine process dies mid-stream: the stream ends with an error, not a hang
            g = group([5, 6, 7], max_tokens=100, name="doomed")
            await pe.add(g)
            await asyncio.wait_for(g.next(), 60)
            os.kill(pe.pid, 9)
            items = await finish(g, timeout=30)
            assert isinstance(items[-1].error, EngineError) and "exited" in str(items[-1].error)
            await until(lambda: not pe.is_alive)
            with pytest.raises(EngineGone, match="exited"):  # the server's 503, not the client's fault
                await pe.add(group([5, 6], name="late"))
        finally:
            await pe.shutdown()

    asyncio.run(main())


def test_a_builder_error_reaches_ready():
    async def main():
        pe = ProcessEngine(EngineConfig.from_kwargs("/no/such/checkpoint"))
        pe.start()
        with pytest.raises(FileNotFoundError, match="no such checkpoint"):
            await pe.ready()
        await pe.shutdown()

    asyncio.run(main())


def test_the_engine_process_exits_when_the_server_process_dies_and_needs_no_main_guard(tmp_path):
    script = textwrap.dedent("""
        import asyncio, os, sys
        from twospeed.config import EngineConfig
        from twospeed.serving.process_engine import ProcessEngine

        async def main():
            pe = ProcessEngine(EngineConfig.from_kwargs("demo", num_gpu_blocks=32, max_model_len=128, num_threads=1))
            pe.start()
            await pe.ready()
            print(pe.pid, flush=True)
            os._exit(0)  # no shutdown: as if killed

        asyncio.run(main())  # no `if __name__ == "__main__"`: the engine process must not run this script again
    """)
    path = tmp_path / "server.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_server_side_never_imports_torch_or_a_grammar_compiler(tmp_path):
    """The server's process (and a cluster's ingress and replica actors) reads the engine's facts and messages
    without torch: importing the app and unpickling an engine's EngineFacts load no torch (a torch object in the
    facts, or a torch-importing module on the server's path, fails this). Nor llguidance: a request's grammar is
    compiled once, beside the engine, never again on the server's side to check it."""
    import pickle

    from twospeed.serving.engine_view import EngineFacts

    engine = LLMEngine(CONFIG)
    facts = EngineFacts.of(engine, "engine", "i", "1")
    dtype = str(engine.dtype).removeprefix("torch.")  # the demo's bf16, or float32 on a CPU without bf16 kernels
    blob = tmp_path / "facts.pickle"
    blob.write_bytes(pickle.dumps(facts))
    code = textwrap.dedent(f"""
        import pickle, sys
        import twospeed.server.app, twospeed.cluster.client, twospeed.cluster.replica, twospeed.cli
        facts = pickle.loads(open({str(blob)!r}, "rb").read())
        assert facts.dtype == {dtype!r} and facts.vocab_size > 0, facts
        loaded = sorted(m for m in sys.modules if m in ("torch", "llguidance") or m.startswith("twospeed.model.llama"))
        print(loaded)
        sys.exit(1 if loaded else 0)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_serve_starts_its_engine_process_before_it_loads_its_web_stack():
    """`twospeed serve` hands the engine process its config before it imports FastAPI and uvicorn, so that process's
    torch import and model load run beside them."""
    code = textwrap.dedent("""
        import sys
        from twospeed import cli
        from twospeed.serving.engine_spawn import EngineSpawn

        def start(config, nice=0):
            print(config.model, nice, sorted(m for m in ("fastapi", "uvicorn", "torch") if m in sys.modules))
            sys.exit(0)

        EngineSpawn.start = start
        sys.exit(cli.main(["serve", "--model", "demo", "--port", "0", *sys.argv[1:]]) or 3)
    """)
    run = subprocess.run([sys.executable, "-c", code, "--engine-nice", "2"], capture_output=True, text=True,
                         timeout=120)
    assert (run.returncode, run.stdout) == (0, "demo 2 []\n"), run.stderr


class _Pipe:
    """The engine process's result pipe, as bytes: what each message would cost to send, less the cost model's
    snapshot (a fixed size once a second, so whether one lands on a step that also carries a LoadEvent is timing,
    not the stream's length)."""

    def __init__(self):
        self.sizes: list[int] = []
        self.last = None

    def send(self, message) -> None:
        sized = dataclasses.replace(message, cost_profile=None) if isinstance(message, Outbox) else message
        self.sizes.append(len(pickle.dumps(sized)))
        self.last = message


def test_a_long_stream_costs_the_same_per_step_at_its_end_as_at_its_start():
    """One 2,000-token stream through the engine process's loop and pipe sink, read by its RequestGroup as the
    server does: the bytes each step sends and the Python memory each step allocates (engine emit, loop, sink,
    pickling, the group's adding up) stay flat with length. Copying the whole output per step (as RequestOutput
    and the old wire did) grows both by the output's size: 16 KB a step at the end here."""
    from twospeed.serving.engine_loop import AddGroup, EngineLoop
    from twospeed.serving.engine_child import _PipeSink

    n = 2000
    # demo-draft (demo's first 2 layers): what is measured is the serving plumbing per step, not the model's work
    engine = LLMEngine(EngineConfig.from_kwargs("demo-draft", num_gpu_blocks=300, max_model_len=n + 8, num_threads=1,
                                                cost_probe=False))
    pipe = _Pipe()
    sink = _PipeSink(pipe)
    loop = EngineLoop(engine, sink, listeners=[sink.listen])
    sink.loop = loop
    g = RequestGroup(Admission("default", 0, time.monotonic(), [SequenceSpec(
        "long", [5, 6, 7], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2), 0)]))
    loop.submit(AddGroup(g.admit(), 0))
    loop._drain_commands()
    sink.flush()
    peaks = {}  # step -> Python memory it allocated at its peak, traced at the start and near the end only
    traced = set(range(100, 500)) | set(range(n - 500, n - 100))
    try:
        for step in range(n):
            if step in traced and not tracemalloc.is_tracing():
                tracemalloc.start()
            elif step not in traced and tracemalloc.is_tracing():
                tracemalloc.stop()
            if tracing := tracemalloc.is_tracing():
                before, _ = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
            sent = len(pipe.sizes)
            loop._step()
            sink.flush()
            if len(pipe.sizes) > sent:
                for item in pipe.last.items:
                    g.take(item)
            if tracing:
                peaks[step] = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert not engine.has_unfinished_requests()
    out = g.seqs["long"]
    assert len(out.token_ids) == n and out.finish is not None and len(out.logprobs) == n
    steps = pipe.sizes[1:]  # the add's message first
    early, late = steps[100:500], steps[-500:-100]
    assert max(late) <= max(early) + 64, (max(early), max(late))  # bytes on the pipe: flat
    early, late = sorted(peaks[i] for i in range(100, 500)), sorted(peaks[i] for i in range(n - 500, n - 100))
    assert late[len(late) // 2] <= 1.25 * early[len(early) // 2] + 2048, (early[len(early) // 2], late[len(late) // 2])


def test_the_server_side_loads_the_tokenizer_the_engine_was_told_to():
    """--tokenizer FOLDER: the server's view loads that folder's tokenizer, as the engine did, not the checkpoint's."""
    import dataclasses

    from twospeed.builtin.demo import demo_checkpoint_path
    from twospeed.serving.engine_view import EngineFacts, load_tokenizer

    facts = EngineFacts.of(LLMEngine(CONFIG), "engine", "i", "1")
    assert load_tokenizer(facts).encode("hello") == LLMEngine(CONFIG).tokenizer.encode("hello")
    other = dataclasses.replace(facts, model_path="/nonexistent",
                                config=dataclasses.replace(facts.config, model="/nonexistent",
                                                           tokenizer=str(demo_checkpoint_path())))
    assert load_tokenizer(other).vocab_size == load_tokenizer(facts).vocab_size
