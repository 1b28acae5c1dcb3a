"""The response's `twospeed` object: what the server writes, the lab reads back field for field (a round trip over
random clocks, bills, verdicts and speculation traces), and a reader never trips on an object it does not know."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed.schema.clock import Bill, Clock, SpecTrace, clock_json, merged_clock_json
from twospeed.schema.slo import Verdict
from twospeed.schema.twospeed_object import SequenceFacts, read_twospeed, twospeed_object

small = st.integers(0, 10_000)


@st.composite
def sequences(draw, index: int) -> SequenceFacts:
    arrival = draw(st.floats(0, 100))
    queue, prefill = draw(st.floats(0, 2)), draw(st.floats(0, 2))
    gaps = draw(st.lists(st.floats(0, 0.5), max_size=20))
    first = arrival + queue + prefill
    times = [first + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    clock = Clock(arrival, first_scheduled=arrival + queue, prefill_done=first, first_token=first, token_times=times,
                  finished=times[-1], decode_steps=len(gaps), interfered_steps=draw(st.integers(0, len(gaps))))
    bill = Bill(*(draw(small) for _ in range(9)))
    verdict = draw(st.none() | st.builds(lambda met, missed: Verdict("a", met, None if met else "decode",
                                                                     [] if met else missed),
                                         st.booleans(), st.lists(st.sampled_from(["ttft_p99", "itl_p99"]),
                                                                 min_size=1, unique=True)))
    spec = None
    if draw(st.booleans()):
        spec = SpecTrace("ngram")
        for proposed in draw(st.lists(st.integers(1, 4), max_size=5)):
            spec.record(proposed, draw(st.integers(0, proposed)))
    return SequenceFacts(index, clock, bill, draw(st.integers(0, 3)), verdict, spec)


@settings(max_examples=100)
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(*(sequences(i) for i in range(n)))))
def test_what_the_server_writes_the_lab_reads(seqs):
    obj = twospeed_object("a", list(seqs))
    report = read_twospeed(obj)
    clock = merged_clock_json([s.clock for s in seqs]) if len(seqs) > 1 else clock_json(seqs[0].clock)
    c = report.clock
    assert (c.queue_ms, c.prefill_ms, c.ttft_ms, c.ttlt_ms, c.tpot_ms) == (
        clock["queue_ms"], clock["prefill_ms"], clock["ttft_ms"], clock["ttlt_ms"], clock["tpot_ms"])
    assert (c.itl_p50_ms, c.itl_p99_ms, c.itl_max_ms) == tuple(clock["itl_ms"][k] for k in ("p50", "p99", "max"))
    assert (c.decode_steps, c.interfered_steps) == (clock["decode_steps"], clock["interfered_steps"])
    summed = {k: sum(getattr(s.bill, k) for s in seqs) for k in Bill().as_dict()}
    assert report.bill.as_dict() == summed
    assert report.num_preemptions == sum(s.num_preemptions for s in seqs)
    verdicts = [s.verdict for s in seqs if s.verdict is not None]
    if not verdicts:
        assert report.slo is None
    else:
        assert report.slo.met == all(v.met for v in verdicts)
        assert set(report.slo.missed) == {m for v in verdicts if not v.met for m in v.missed}
    traces = [s.spec for s in seqs if s.spec is not None]
    if not traces:
        assert report.spec is None
    else:
        steps = sum(t.verify_steps for t in traces)
        assert (report.spec.verify_steps, report.spec.accepted) == (steps, sum(t.accepted for t in traces))
        assert report.spec.mean_acceptance_length == (round(1 + report.spec.accepted / steps, 4) if steps else None)
    assert len(obj.get("choices", [])) == (len(seqs) if len(seqs) > 1 else 0)


def test_an_object_it_does_not_know_reads_as_none_or_empty():
    assert read_twospeed(None) is None and read_twospeed({}) is None and read_twospeed([1]) is None
    partial = read_twospeed({"clock": {"ttft_ms": 5.0}, "bill": {"prompt_tokens": 3, "a_later_field": 1}})
    assert partial.clock.ttft_ms == 5.0 and partial.clock.queue_ms is None
    assert partial.bill == Bill(prompt_tokens=3) and partial.slo is None and partial.spec is None
