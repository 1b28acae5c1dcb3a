"""The fallback policy against its definition: the expected gain E(alpha, gamma) / (gamma c + 1) against a
brute-force sum, and the per-request and per-lane decisions on scripted verify steps (fall back below 1, re-probe
after the wait, doubling up to 8x, resume, gamma following the best gain, a lane's estimate starting a new request
off, the off switches). Torch-free and exact: every decision is named in the trace with the estimates behind it."""

from __future__ import annotations

import pytest

from twospeed.config import SpecConfig
from twospeed.engine.request import Request
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.spec_policy import MAX_BACKOFF, MIN_EVIDENCE, SpecPolicy, expected_gain, expected_tokens


def request(rid: str = "r", lane: str = "default") -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=10_000), arrival_time=0.0, max_output_tokens=10_000,
                   lane=lane)


def step(policy: SpecPolicy, req: Request, accepted: int | None, cost: float = 0.1) -> int:
    """One decode step of req: the gamma the policy grants; if it is > 0, a verify step keeping `accepted` of them
    (None: all). Returns the gamma."""
    gamma = policy.gamma(req)
    req.clock.decode_steps += 1
    if gamma:
        policy.observe(req, gamma, gamma if accepted is None else min(accepted, gamma), cost)
    return gamma


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_expected_tokens_and_gain_against_the_sum(alpha, gamma):
    # a verify step yields 1 + the kept drafts; draft i is reached and kept with probability alpha^i
    assert expected_tokens(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)))
    assert expected_gain(alpha, gamma, 0.25) == pytest.approx(expected_tokens(alpha, gamma) / (gamma * 0.25 + 1))
    assert expected_gain(alpha, gamma, 0.0) >= 1.0  # free drafts never lose


def test_a_request_the_draft_never_matches_falls_back_then_reprobes_with_a_growing_wait():
    cfg = SpecConfig(method="ngram", num_speculative_tokens=4, reprobe_steps=5)
    policy, req = SpecPolicy(cfg), request()
    policy.start(req)
    granted = [step(policy, req, 0) for _ in range(MIN_EVIDENCE)]
    assert granted == [4] * MIN_EVIDENCE  # speculates until it has its own evidence
    fallback = req.spec.events[-1]
    assert (fallback.event, fallback.cause, fallback.step) == ("fallback", "low_gain", MIN_EVIDENCE)
    assert fallback.alpha == 0.0 and fallback.gain == pytest.approx(expected_gain(0.0, 1, 0.1))  # the best gamma's
    assert [step(policy, req, 0) for _ in range(5)] == [0] * 5  # one token at a time for reprobe_steps
    waits = [5]
    for _ in range(5):  # each failed probe: MIN_EVIDENCE verify steps, then a wait twice the last, at most 8x
        assert step(policy, req, 0) == 4
        assert req.spec.events[-1].event == "reprobe"
        for _ in range(MIN_EVIDENCE - 1):
            assert step(policy, req, 0) == 4
        assert req.spec.events[-1].event == "fallback"
        wait = 0
        while policy.gamma(req) == 0:
            req.clock.decode_steps += 1
            wait += 1
        waits.append(wait)
    assert waits == [5, 10, 20, 40, 40, 40] and MAX_BACKOFF * 5 == 40


def test_a_probe_that_pays_resumes_and_resets_the_wait():
    cfg = SpecConfig(method="ngram", num_speculative_tokens=3, reprobe_steps=4)
    policy, req = SpecPolicy(cfg), request()
    policy.start(req)
    for _ in range(MIN_EVIDENCE):
        step(policy, req, 0)
    while policy.gamma(req) == 0:
        req.clock.decode_steps += 1
    for _ in range(MIN_EVIDENCE):  # the traffic turned templated: every draft kept
        step(policy, req, None)
    assert [e.event for e in req.spec.events] == ["fallback", "reprobe", "resume"]
    assert req.spec_state.mode == "on" and req.spec_state.backoff == 4 and policy.gamma(req) == 3


def test_gamma_follows_the_highest_expected_gain():
    """Half the drafts kept at a steep cost per draft: the best gamma is below the maximum, as brute force says."""
    cfg = SpecConfig(method="ngram", num_speculative_tokens=6)
    policy, req = SpecPolicy(cfg), request()
    policy.start(req)
    cost = 0.3
    for _ in range(MIN_EVIDENCE + 3):
        gamma = policy.gamma(req)
        req.clock.decode_steps += 1
        policy.observe(req, gamma, 1, cost)  # one kept, the next rejected (while gamma > 1): alpha near 1/2
    alpha = req.spec_state.estimate.alpha
    assert 0.5 <= alpha < 0.7 and req.spec_state.estimate.cost_ratio == pytest.approx(cost)
    best = max(range(1, 7), key=lambda g: expected_gain(alpha, g, cost))
    assert expected_gain(alpha, best, cost) > 1 and best < 6
    assert policy.gamma(req) == best
    changes = [e for e in req.spec.events if e.event == "gamma"]
    for e in changes:  # each change names the gamma of the highest gain at the estimate it was made on
        assert e.gamma == max(range(1, 7), key=lambda g: expected_gain(e.alpha, g, e.cost_ratio))
        assert e.gain == pytest.approx(expected_gain(e.alpha, e.gamma, e.cost_ratio))
    assert changes[0].alpha == 0.5 and changes[-1].gamma == best


def test_a_lane_whose_drafts_do_not_pay_starts_new_requests_off_and_another_lane_keeps_speculating():
    cfg = SpecConfig(method="ngram", num_speculative_tokens=4, reprobe_steps=8)
    policy = SpecPolicy(cfg)
    for i in range(2):
        chat = request(f"chat{i}", "chat")
        policy.start(chat)
        for _ in range(MIN_EVIDENCE):
            step(policy, chat, 0)
    agent = request("agent0", "agent")
    policy.start(agent)
    for _ in range(MIN_EVIDENCE):
        step(policy, agent, None)
    late_chat, late_agent = request("chat9", "chat"), request("agent9", "agent")
    policy.start(late_chat)
    policy.start(late_agent)
    (event,) = late_chat.spec.events
    assert (event.event, event.cause, event.step) == ("fallback", "lane_estimate", 0)
    assert policy.gamma(late_chat) == 0 and policy.gamma(late_agent) == 4 and not late_agent.spec.events
    late_chat.clock.decode_steps = 8
    assert policy.gamma(late_chat) == 4  # the lane's requests re-probe on the same schedule


def test_without_auto_fallback_it_always_proposes_gamma():
    policy, req = SpecPolicy(SpecConfig(method="ngram", num_speculative_tokens=2, auto_fallback=False)), request()
    policy.start(req)
    assert [step(policy, req, 0) for _ in range(20)] == [2] * 20 and not req.spec.events


@pytest.mark.parametrize("off", ["opted_out", "lane_policy"])
def test_the_off_switches_keep_a_request_off_and_say_why(off):
    policy, req = SpecPolicy(SpecConfig(method="draft", draft_model="demo-draft", reprobe_steps=1)), request()
    policy.start(req, off)
    assert [step(policy, req, None) for _ in range(10)] == [0] * 10
    (event,) = req.spec.events
    assert (event.event, event.cause) == ("off", off) and req.spec.method == "draft"


def test_the_cost_ratio_is_measured_once_both_step_kinds_ran():
    """A cost model that says a verify step costs what a plain one does (the linear fit's blind spot where a few
    more rows change the CPU's linear kernel) is overruled by the measured steps of that shape; before both kinds
    were seen, and for steps with a prompt chunk, the model's prediction stands."""
    from twospeed.engine.cost_model import StepShape
    from twospeed.engine.spec import NgramProposer, Speculator

    class FlatModel:
        def predict(self, shape):
            return 0.010  # every step 10 ms, drafts or not

    spec = Speculator(SpecConfig(method="ngram"), NgramProposer(1, 3), 1024)
    verify = StepShape(decode_tokens=2, decode_context=200, sampled=8, draft_tokens=6, draft_attention=600)
    plain = verify.without_drafts()
    assert spec.cost_ratio(verify, FlatModel()) == pytest.approx(spec.propose_seconds / 0.010)  # the model's word
    spec.observe_step(verify, 0.030)
    assert spec.cost_ratio(verify, FlatModel()) == pytest.approx(spec.propose_seconds / 0.010)  # no plain twin yet
    for seconds in (0.010, 0.010, 0.010):
        spec.observe_step(plain, seconds)
    spec.observe_step(StepShape(prefill_tokens=64, decode_tokens=2), 0.500)  # a prompt chunk's step: ignored
    assert spec.cost_ratio(verify, FlatModel()) == pytest.approx(2.0 + spec.propose_seconds / 0.010)
    chunked = StepShape(prefill_tokens=16, decode_tokens=2, sampled=8, draft_tokens=6)
    assert spec.cost_ratio(chunked, FlatModel()) == pytest.approx(spec.propose_seconds / 0.010)
