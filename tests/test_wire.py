"""The hop between the ingress and a replica, without Ray: a real engine's outputs, encoded on the "replica" (whose
clock runs 1234.5 s ahead, as another machine's may), pickled, and assembled on the "ingress", are the engine's
own outputs field by field (stop strings holding text back, logprobs, errors, aborts), with every duration of the
clock exact; the merged /metrics of two replicas parse and sum to theirs; the merged dashboard history sums their
totals and its cursor neither repeats nor drops a record.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from prometheus_client.parser import text_string_to_metric_families

from twospeed import LLM, SamplingParams
from twospeed.cluster.history import merge_histories
from twospeed.cluster.metrics import merge_expositions
from twospeed.server.wire import STAMPS, Assembler, Encoder, TimeBase, shift_clock
from twospeed.engine.request import Clock, RequestOutput
from twospeed.server.request_group import EngineError, SequenceSpec, ShutdownError, StreamItem
from twospeed.server.events import FinishEvent, StepEvent
from twospeed.server.history import History
from twospeed.server.metrics import ServerMetrics
from twospeed.server.slo import Verdict

SKEW = 1234.5


@pytest.fixture(scope="module")
def engine():
    # speculating (ngram over the repeated words below), so speculation's trace crosses the hop too
    return LLM("demo", num_gpu_blocks=64, max_model_len=256, spec_method="ngram", prompt_lookup_min=1).engine


def run(engine, specs: list[SequenceSpec]) -> tuple[list[StreamItem], dict]:
    """Step the engine over the specs; the StreamItems an AsyncEngine would post, and each finished Request."""
    requests = {s.request_id: engine.add_request(s.request_id, s.prompt_token_ids, s.params) for s in specs}
    index = {s.request_id: s.index for s in specs}
    items = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            k = len(out.new_token_ids)
            times = list(requests[out.request_id].clock.token_times[-k:]) if k else []
            verdict = Verdict("default", True) if out.finished else None
            items.append(StreamItem(out.request_id, index[out.request_id], dataclasses.replace(
                out, clock=dataclasses.replace(out.clock, token_times=list(out.clock.token_times))), times, verdict))
    return items, requests


def test_the_clocks_stamps_are_all_shifted():
    stamps = {f.name for f in dataclasses.fields(Clock) if f.type == "float | None"} | {"arrival"}
    assert set(STAMPS) == stamps  # a new stamp on Clock must cross the hop too (durations are plain floats)
    c = Clock(arrival=1.0, first_scheduled=2.0, token_times=[3.0, 4.0], routed=1.5)
    moved = shift_clock(c, 10.0)
    assert (moved.arrival, moved.routed, moved.token_times, moved.first_token) == (11.0, 11.5, [13.0, 14.0], None)
    assert moved.queue_time == c.queue_time and moved.route_time == c.route_time


def test_deltas_rebuild_the_engines_outputs_exactly(engine):
    prompt = engine.tokenizer.encode("the latency of a token is two speeds you you you")
    specs = [SequenceSpec("a", prompt, SamplingParams(max_tokens=24, temperature=0, stop=["u y"]), 0),
             SequenceSpec("b", prompt[:7], SamplingParams(max_tokens=9, temperature=0, logprobs=3), 1),
             SequenceSpec("c", prompt[3:], SamplingParams(max_tokens=12, temperature=0.8, seed=7,
                                                          stop_token_ids=[5]), 2)]
    items, _ = run(engine, specs)
    replica, ingress = TimeBase(), TimeBase()
    replica.offset += SKEW  # the replica's wall clock runs ahead: absolute times move, durations do not
    encoder, assembler = Encoder(replica), Assembler(specs, 0.0, ingress)
    compared = ("request_id", "token_ids", "text", "new_token_ids", "new_text", "finished", "finish_reason",
                "stop_reason", "prompt_token_ids", "num_preemptions", "error")
    # Every field of RequestOutput crosses the hop (a new one must be added to wire.py and here); the prompt text is
    # None in the server (it sends token ids) and the clock, bill and speculation trace are compared below.
    assert {f.name for f in dataclasses.fields(RequestOutput)} == {*compared, "logprobs", "clock", "bill", "prompt",
                                                                   "spec"}
    held_back = 0
    for item in items:
        delta = pickle.loads(pickle.dumps(encoder.delta(item)))
        held_back += delta.text is not None
        got, want = assembler.item(delta), item.output
        for name in compared:
            assert getattr(got.output, name) == getattr(want, name), name
        assert got.output.logprobs == want.logprobs
        # absolute times: the two TimeBases' offsets (time.time() - time.monotonic(), read a moment apart) differ
        # by the clocks' drift in between, a microsecond or so on a loaded machine
        assert got.token_times == pytest.approx([t + SKEW for t in item.token_times], abs=1e-4)
        if want.finished:
            assert got.verdict == item.verdict and got.output.bill == want.bill and got.output.spec == want.spec
            for name in ("queue_time", "prefill_time", "ttft", "tpot", "ttlt"):
                assert getattr(got.output.clock, name) == pytest.approx(getattr(want.clock, name), abs=1e-6)
            assert got.output.clock.itl == pytest.approx(want.clock.itl, abs=1e-6)
            assert got.output.clock.arrival == pytest.approx(want.clock.arrival + SKEW, abs=1e-4)
    assert held_back  # the stop string held text back at least once, so `text` crossed on its own
    assert any(i.output.logprobs for i in items)
    assert any(i.output.finished and i.output.spec.proposed for i in items)


def test_errors_and_aborts_cross_with_their_kind():
    spec = SequenceSpec("x", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    base = TimeBase()
    encoder, assembler = Encoder(base), Assembler([spec], 0.0, base)
    engine_failed = assembler.item(encoder.delta(StreamItem("x", 0, None, [], error=EngineError("boom"))))
    assert isinstance(engine_failed.error, EngineError) and str(engine_failed.error) == "boom"
    assert engine_failed.output is None and engine_failed.finished
    closed = assembler.item(encoder.delta(StreamItem("", -1, None, [], error=ShutdownError("bye"), ends_group=True)))
    assert isinstance(closed.error, ShutdownError) and closed.ends_group


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
