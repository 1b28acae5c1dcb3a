"""A request's split clock and bill from exact timestamps, without a model (no torch; part of `make mutation`):
every derived field against its definition in docs/ARCHITECTURE.md, percentiles against numpy."""

from __future__ import annotations

import time

import numpy as np
import pytest

from twospeed.engine.request import Bill, Clock, Request, RequestStatus, percentile
from twospeed.engine.sampling_params import SamplingParams


def finished_clock() -> Clock:
    """arrival 10, scheduled 10.5, prompt done 11.25, tokens at 11.5, 11.5 (jump-forward), 12, 13.5; finished 14."""
    return Clock(arrival=10.0, first_scheduled=10.5, prefill_done=11.25, first_token=11.5,
                 token_times=[11.5, 11.5, 12.0, 13.5], finished=14.0)


def test_derived_clock_fields():
    c = finished_clock()
    assert (c.queue_time, c.prefill_time, c.ttft, c.ttlt) == (0.5, 0.75, 1.5, 4.0)
    assert c.itl == [0.0, 0.5, 1.5]  # tokens emitted in the same step have gap 0
    assert c.tpot == pytest.approx((4.0 - 1.5) / 3)
    s = c.summary()
    assert s == {"queue_time": 0.5, "route_time": None, "prefill_time": 0.75, "ttft": 1.5, "itl_p50": 0.5,
                 "itl_p99": pytest.approx(np.percentile([0.0, 0.5, 1.5], 99)), "itl_max": 1.5,
                 "tpot": pytest.approx(2.5 / 3), "ttlt": 4.0}


def test_missing_timestamps_give_none():
    c = Clock(arrival=1.0)
    assert (c.queue_time, c.prefill_time, c.ttft, c.ttlt, c.tpot) == (None,) * 5
    assert c.itl == [] and c.summary()["itl_p50"] is None and c.summary()["itl_max"] is None
    c.prefill_done = 2.0  # without first_scheduled there is no prefill time
    assert c.prefill_time is None
    c = Clock(arrival=1.0, first_scheduled=1.5)
    assert c.queue_time == 0.5 and c.prefill_time is None and c.route_time is None
    routed = Clock(arrival=1.0, routed=1.25, first_scheduled=1.5)
    assert routed.route_time == 0.25 and routed.queue_time == 0.5 and routed.summary()["route_time"] == 0.25
    one = Clock(arrival=0.0, first_token=1.0, token_times=[1.0], finished=2.0)
    assert one.tpot is None and one.ttlt == 2.0  # one token: no time per output token
    two = Clock(arrival=0.0, first_token=1.0, token_times=[1.0, 3.0])
    assert two.tpot is None  # not finished


@pytest.mark.parametrize("values", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0], list(np.linspace(0, 1, 17) ** 2)])
@pytest.mark.parametrize("p", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, p):
    assert percentile(sorted(values), p) == pytest.approx(np.percentile(values, p), rel=1e-12, abs=1e-15)


def test_percentile_of_nothing():
    assert percentile([], 50) is None


def test_bill_as_dict_and_status():
    b = Bill(prompt_tokens=1, cached_tokens=2, prefilled_tokens=3, output_tokens=4, recomputed_tokens=5,
             forced_tokens=6, spec_proposed=7, spec_accepted=8, spec_rejected=9)
    assert b.as_dict() == {"prompt_tokens": 1, "cached_tokens": 2, "prefilled_tokens": 3, "output_tokens": 4,
                           "recomputed_tokens": 5, "forced_tokens": 6, "spec_proposed": 7, "spec_accepted": 8,
                           "spec_rejected": 9}
    assert [s.finished for s in RequestStatus] == [False, False, False, True, True, True, True]
    assert [s.value for s in RequestStatus] == ["waiting", "running", "preempted", "stop", "length", "abort", "error"]


def test_request_tokens_clock_and_eos():
    params = SamplingParams(max_tokens=3)
    r = Request("r", [5, 6], params, arrival_time=2.0, priority=4, eos_token_ids=frozenset({2}), max_output_tokens=3)
    assert (r.num_prompt_tokens, r.num_tokens, r.num_computed_tokens, r.priority) == (2, 2, 0, 4)
    assert r.status == RequestStatus.WAITING and not r.is_finished and r.finish_reason is None
    assert r.bill.prompt_tokens == 2 and r.clock.arrival == 2.0 and r.eos_token_ids == {2}
    r.append_token(9, 3.0)
    r.append_token(8, 3.5)
    assert r.all_token_ids == [5, 6, 9, 8] and r.output_token_ids == [9, 8] and r.prompt_token_ids == [5, 6]
    assert r.bill.output_tokens == 2 and r.clock.first_token == 3.0 and r.clock.token_times == [3.0, 3.5]
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"
    assert repr(r) == "Request('r', FINISHED_LENGTH, computed=0/4, prompt=2)"
    assert (r.prompt, r.params, r.stop_reason, r.logprobs, r.num_preemptions, r.high_water) == (None, params, None,
                                                                                                [], 0, 0)
    ignore = Request("i", [1], SamplingParams(ignore_eos=True), prompt="hi", eos_token_ids=frozenset({2}),
                     max_output_tokens=1)
    assert ignore.eos_token_ids == frozenset() and ignore.prompt == "hi" and ignore.priority == 0
    assert 0 < ignore.clock.arrival <= time.monotonic()  # no arrival time given: now
