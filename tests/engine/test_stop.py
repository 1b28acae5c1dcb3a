"""The stop policy (engine/stop.py) case by case, and the bookkeeping and the planner importing without torch.

The engine's own stop behaviour (EOS, stop strings across tokens, grammars) is checked end to end in
tests/engine/test_engine.py and tests/engine/test_structured.py; here each rule of `check_stop` against a hand-made request,
including several new tokens at once, where the first that stops wins.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from twospeed.engine.request import Request, RequestStatus
from twospeed.engine.sampling_params import SamplingParams
from twospeed.engine.stop import Stop, check_stop

ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE = ("twospeed.engine.scheduler", "twospeed.engine.prompt_share", "twospeed.engine.stream_room",
              "twospeed.engine.kv_cache", "twospeed.engine.request", "twospeed.engine.cost_model", "twospeed.engine.stop",
              "twospeed.config",
              "twospeed.plan.sim", "twospeed.plan.capacity", "twospeed.plan.sim_results")


def test_bookkeeping_and_the_simulator_import_no_torch():
    code = (f"import sys; import {', '.join(TORCH_FREE)}; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, f"torch imported: {done.stdout} {done.stderr[-2000:]}"


class FakeDetokenizer:
    """Reports `stop` as found when the token `at` arrives."""

    def __init__(self, at: int, stop: str):
        self.at, self.stop, self.fed = at, stop, []

    def add_tokens(self, tokens):
        self.fed += tokens
        return self.stop if tokens[-1] == self.at else None


class FakeGrammar:
    is_complete = True


def request(max_tokens: int = 10, eos=frozenset({2}), room: int | None = None, **params) -> Request:
    """room: what max_model_len leaves (LLMEngine clips max_tokens to it)."""
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos,
                   max_output_tokens=min(max_tokens, room or max_tokens))


def emit(req: Request, *tokens: int) -> list[int]:
    for t in tokens:
        req.append_token(t, 0.0)
    return list(tokens)


def test_eos_and_ignore_eos():
    req = request()
    assert check_stop(req, emit(req, 9)) is None
    assert check_stop(req, emit(req, 2)) == Stop(RequestStatus.FINISHED_STOPPED, None, 1)
    ignoring = request(ignore_eos=True)
    assert check_stop(ignoring, emit(ignoring, 2)) is None


def test_min_tokens_hold_off_stops_but_not_length():
    req = request(max_tokens=3, min_tokens=3, room=2)
    assert check_stop(req, emit(req, 2)) is None  # EOS before min_tokens: keeps going
    assert check_stop(req, emit(req, 2)) == Stop(RequestStatus.FINISHED_LENGTH, None, 1)


def test_stop_token_ids_and_strings_give_their_reason():
    req = request(stop_token_ids=[11])
    assert check_stop(req, emit(req, 11)) == Stop(RequestStatus.FINISHED_STOPPED, 11, 1)
    req = request(stop=["END"])
    req.detokenizer = FakeDetokenizer(at=13, stop="END")
    assert check_stop(req, emit(req, 12)) is None
    assert check_stop(req, emit(req, 13)) == Stop(RequestStatus.FINISHED_STOPPED, "END", 1)
    assert req.detokenizer.fed == [12, 13]


def test_a_complete_grammar_stops_and_length_is_last():
    req = request()
    req.grammar = FakeGrammar()
    assert check_stop(req, emit(req, 9)) == Stop(RequestStatus.FINISHED_STOPPED, None, 1)
    req = request(max_tokens=2)
    assert check_stop(req, emit(req, 9)) is None
    assert check_stop(req, emit(req, 2)).status == RequestStatus.FINISHED_STOPPED  # EOS wins over length


@pytest.mark.parametrize("tokens, expected", [
    ([9, 2, 9], Stop(RequestStatus.FINISHED_STOPPED, None, 2)),  # EOS second: the third is past the end
    ([9, 9, 9, 9], Stop(RequestStatus.FINISHED_LENGTH, None, 3)),  # max_tokens 3 reached at the third
    ([9, 11], Stop(RequestStatus.FINISHED_STOPPED, 11, 2)),
    ([9, 9], None),
])
def test_several_new_tokens_stop_at_the_first_that_ends(tokens, expected):
    req = request(max_tokens=3, stop_token_ids=[11])
    req.detokenizer = FakeDetokenizer(at=-1, stop="never")
    assert check_stop(req, emit(req, *tokens)) == expected
    assert req.detokenizer.fed == tokens[: expected.num_tokens if expected else len(tokens)]
