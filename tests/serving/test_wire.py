"""The hop between the ingress and a replica, without Ray: a real engine's deltas, sent from the "replica" (whose
clock runs 1234.5 s ahead, as another machine's may), pickled, and added up by the ingress's RequestGroup, give the
engine's own whole outputs field by field (stop strings holding text back, logprobs, errors, aborts), with every
duration of the clock exact; the merged /metrics of two replicas parse and sum to theirs; the merged dashboard
history sums their totals and its cursor neither repeats nor drops a record.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from prometheus_client.parser import text_string_to_metric_families

from twospeed import LLM, SamplingParams
from twospeed.cluster.history import merge_histories
from twospeed.cluster.metrics import merge_expositions
from twospeed.engine.outputs import RequestDelta
from twospeed.serving.wire import STAMPS, TimeBase, from_wire, shift_clock, to_wire
from twospeed.engine.request import Clock, RequestOutput
from twospeed.serving.request_group import Admission, EngineError, RequestGroup, SequenceSpec, ShutdownError, StreamItem
from twospeed.serving.events import FinishEvent, StepEvent
from twospeed.server.history import History
from twospeed.server.metrics import ServerMetrics
from twospeed.schema.slo import Verdict

SKEW = 1234.5


@pytest.fixture(scope="module")
def engine():
    # speculating (ngram over the repeated words below), so speculation's trace crosses the hop too
    return LLM("demo", num_gpu_blocks=64, max_model_len=256, spec_method="ngram", prompt_lookup_min=1).engine


def outputs(engine, specs: list[SequenceSpec]) -> dict[str, RequestOutput]:
    """The engine's whole outputs (LLMEngine.step), the reference the deltas must add up to."""
    for s in specs:
        engine.add_request(s.request_id, s.prompt_token_ids, s.params)
    final = {}
    while engine.has_unfinished_requests():
        final |= {out.request_id: out for out in engine.step() if out.finished}
    return final


def items(engine, specs: list[SequenceSpec]) -> list[StreamItem]:
    """Step the engine over the specs; the StreamItems an engine loop would post (LLMEngine.step_deltas)."""
    for s in specs:
        engine.add_request(s.request_id, s.prompt_token_ids, s.params)
    index = {s.request_id: s.index for s in specs}
    posted = []
    while engine.has_unfinished_requests():
        posted += [StreamItem(d.request_id, index[d.request_id], d, Verdict("default", True) if d.finished else None)
                   for d in engine.step_deltas()]
    return posted


def test_the_clocks_stamps_are_all_shifted():
    stamps = {f.name for f in dataclasses.fields(Clock) if f.type == "float | None"} | {"arrival"}
    assert set(STAMPS) == stamps  # a new stamp on Clock must cross the hop too (durations are plain floats)
    c = Clock(arrival=1.0, first_scheduled=2.0, token_times=[3.0, 4.0], routed=1.5)
    moved = shift_clock(c, 10.0)
    assert (moved.arrival, moved.routed, moved.token_times, moved.first_token) == (11.0, 11.5, [13.0, 14.0], None)
    assert moved.queue_time == c.queue_time and moved.route_time == c.route_time


def test_deltas_add_up_to_the_engines_outputs_exactly(engine):
    prompt = engine.tokenizer.encode("the latency of a token is two speeds you you you")
    specs = [SequenceSpec("a", prompt, SamplingParams(max_tokens=24, temperature=0, stop=["u y"]), 0),
             SequenceSpec("b", prompt[:7], SamplingParams(max_tokens=9, temperature=0, logprobs=3, prompt_logprobs=2),
                          1),
             SequenceSpec("c", prompt[3:], SamplingParams(max_tokens=12, temperature=0.8, seed=7,
                                                          stop_token_ids=[5]), 2)]
    want = outputs(engine, specs)
    replica, ingress = TimeBase(), TimeBase()
    replica.offset += SKEW  # the replica's wall clock runs ahead: absolute times move, durations do not
    group = RequestGroup(Admission("default", 0, 0.0, specs))
    compared = ("request_id", "token_ids", "text", "finished", "finish_reason", "stop_reason", "prompt_token_ids",
                "num_preemptions", "error")
    # Every field of RequestOutput reaches the ingress (a new one must be added to engine/outputs.py and here); the
    # prompt text is None in the server (it sends token ids), the new_* fields are the deltas', and the clock, bill
    # and speculation trace are compared below.
    assert {f.name for f in dataclasses.fields(RequestOutput)} == {*compared, "logprobs", "clock", "bill", "prompt",
                                                                   "spec", "new_token_ids", "new_text",
                                                                   "prompt_logprobs"}
    streamed: dict[str, str] = {}
    finals = {}
    for item in items(engine, specs):
        crossed = from_wire(pickle.loads(pickle.dumps(to_wire(item, replica))), ingress)
        assert item.delta.token_times is not crossed.delta.token_times  # the replica's own objects stay its own
        got = group.take(crossed)
        streamed[got.request_id] = streamed.get(got.request_id, "") + got.delta.new_text
        # absolute times: the two TimeBases' offsets (time.time() - time.monotonic(), read a moment apart) differ
        # by the clocks' drift in between, a microsecond or so on a loaded machine
        assert got.delta.token_times == pytest.approx([t + SKEW for t in item.delta.token_times], abs=1e-4)
        assert len(got.delta.new_token_ids) == len(got.delta.token_times)
        if got.output is not None:
            finals[got.request_id] = got
            sent = item.delta.finish.clock  # the replica's clock: every duration crosses exactly
            for name in ("queue_time", "prefill_time", "ttft", "tpot", "ttlt"):
                assert getattr(got.output.clock, name) == pytest.approx(getattr(sent, name), abs=1e-6)
            assert got.output.clock.itl == pytest.approx(sent.itl, abs=1e-6)
            assert got.output.clock.arrival == pytest.approx(sent.arrival + SKEW, abs=1e-4)
    assert set(finals) == set(want) == {"a", "b", "c"} and group.done
    for rid, got in finals.items():
        out, ref = got.output, want[rid]
        for name in compared:
            assert getattr(out, name) == getattr(ref, name), name
        assert out.logprobs == ref.logprobs and out.bill == ref.bill and out.spec == ref.spec
        assert out.prompt_logprobs == ref.prompt_logprobs
        assert streamed[rid] == out.text  # what streamed adds up to the whole text (held-back text included)
        assert got.verdict == Verdict("default", True)
        assert len(out.clock.token_times) == len(ref.clock.token_times)
    assert finals["a"].output.stop_reason == "u y"  # the stop string held text back and cut it
    assert finals["b"].output.logprobs and len(finals["b"].output.logprobs) == 9
    assert len(finals["b"].output.prompt_logprobs) == 7 and finals["b"].output.prompt_logprobs[0] is None
    assert any(f.output.spec.proposed for f in finals.values())


def test_a_delta_carries_only_the_steps_change(engine):
    """A long request's deltas do not grow with its length: a token (or a step's few) each, its text and times;
    the clock, bill and trace once, at the end."""
    spec = SequenceSpec("long", [1, 2, 3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), 0)
    posted = items(engine, [spec])
    sizes = [len(pickle.dumps(i.delta)) for i in posted[:-1]]
    assert len(posted) > 40 and max(sizes[len(sizes) // 2:]) <= max(sizes[:len(sizes) // 4]) + 16
    assert all(i.delta.finish is None for i in posted[:-1]) and posted[-1].delta.finish is not None


def test_errors_and_aborts_cross_with_their_kind():
    spec = SequenceSpec("x", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    base = TimeBase()
    group = RequestGroup(Admission("default", 0, 0.0, [spec]))
    cross = lambda item: group.take(from_wire(pickle.loads(pickle.dumps(to_wire(item, base))), base))  # noqa: E731
    engine_failed = cross(StreamItem("x", 0, None, error=EngineError("boom")))
    assert isinstance(engine_failed.error, EngineError) and str(engine_failed.error) == "boom"
    assert engine_failed.delta is None and engine_failed.output is None and engine_failed.finished
    assert group.done
    closed = cross(StreamItem("", -1, None, error=ShutdownError("bye"), ends_group=True))
    assert isinstance(closed.error, ShutdownError) and closed.ends_group
    assert RequestDelta("x").finished is False


# -- merged metrics and history --------------------------------------------------------------------------------
def feed(engine, n: int, lane: str, metrics: ServerMetrics, history: History, first: int = 0) -> None:
    prompt = engine.tokenizer.encode("merge these " * 6)
    specs = [SequenceSpec(f"{lane}-{first + i}", prompt, SamplingParams(max_tokens=3 + i, temperature=0), i)
             for i in range(n)]
    requests = {s.request_id: engine.add_request(s.request_id, s.prompt_token_ids, s.params) for s in specs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                event = FinishEvent(lane, requests[out.request_id], False, Verdict(lane, True))
                metrics.on_event(event)
                history.on_event(event)
        for listener in (metrics.on_event, history.on_event):
            listener(StepEvent(engine.last_stats))


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_merged_metrics_and_history_add_up_to_the_replicas(engine):
    metrics = [ServerMetrics("demo"), ServerMetrics("demo")]
    histories = [History(), History()]
    feed(engine, 3, "alpha", metrics[0], histories[0])
    feed(engine, 2, "beta", metrics[1], histories[1])
    names = ["engine-0", "engine-1"]
    merged = samples(merge_expositions([(n, m.render().decode()) for n, m in zip(names, metrics)]).decode())
    count = 0
    for name, m in zip(names, metrics):
        for (sample, labels), value in samples(m.render().decode()).items():
            assert merged[(sample, tuple(sorted((*labels, ("replica", name)))))] == value
            count += 1
    assert len(merged) == count  # nothing else, nothing lost

    first = merge_histories([(n, h.since(None)) for n, h in zip(names, histories)], [64, 64])
    feed(engine, 2, "alpha", metrics[0], histories[0], first=3)
    second = merge_histories([(n, h.since(first["now"])) for n, h in zip(names, histories)], [64, 64])
    ids = [r["id"] for doc in (first, second) for r in doc["requests"]]
    assert len(ids) == len(set(ids)) == 7  # every ended sequence once over the two polls
    assert {r["replica"] for r in first["requests"]} == set(names)
    totals = second["totals"]
    assert totals["alpha"]["sequences"] == 5 and totals["beta"]["sequences"] == 2
    assert totals["alpha"]["output_tokens"] == sum(h.since(None)["totals"]["alpha"]["output_tokens"]
                                                   for h in histories[:1])
    steps = first["steps"]
    assert steps["t"] == sorted(steps["t"]) and set(steps["replica"]) == {0, 1}
    assert len(steps["t"]) == sum(len(h.since(None)["steps"]["t"]) for h in histories) - len(second["steps"]["t"])
