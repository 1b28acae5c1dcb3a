"""The step cost model against known truths: a synthetic linear step time it must recover, a machine that gets
twice as slow, adversarial data it must not turn into negative or shrinking predictions, and its
non-negative least-squares solver against a brute-force search over every free set."""

from __future__ import annotations

import copy
import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twospeed.engine.cost_model import FEATURES, LinearCostModel, StepShape, _nonnegative_quadratic

TRUTH = [4e-3, 4e-4, 2e-8, 8e-4, 3e-7, 2e-4]  # s, s/token, s/pair, s/token, s/context token, s/row
PRIOR = [1e-2, 1e-3, 1e-8, 1e-3, 1e-7, 1e-4]


def truth(coef: list[float], shape: StepShape) -> float:
    return sum(c * x for c, x in zip(coef, shape.features()))


def random_shape(rng: random.Random) -> StepShape:
    """0-32 decodes at 10-3000 tokens of context, 0-2 prompt chunks of 2-512 tokens (some sampled)."""
    shape = StepShape()
    for _ in range(rng.randint(0, 32)):
        shape = shape.with_chunk(rng.randint(10, 3000), 1, True, True)
    for _ in range(rng.randint(0, 2)):
        shape = shape.with_chunk(rng.randint(0, 2000), rng.randint(2, 512), False, rng.random() < 0.5)
    return shape if shape.num_tokens else shape.with_chunk(5, 1, True, True)


def shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    return [random_shape(rng) for _ in range(n)]


def test_shape_counts_rows_pairs_and_sampled_rows():
    shape = StepShape().with_chunk(10, 1, True, True).with_chunk(20, 3, True, True).with_chunk(100, 5, False, False)
    assert shape.decode_tokens == 4 and shape.prefill_tokens == 5 and shape.sampled == 2
    assert shape.decode_context == 11 + sum(range(21, 24))  # each row reads its own prefix
    assert shape.prefill_attention == sum(range(101, 106))
    assert shape.num_tokens == 9 and StepShape().features() == (0.0,) * len(FEATURES)


@pytest.mark.parametrize("ridge,tol", [(1e-6, 1e-3), (1e-12, 1e-6)])
def test_fits_a_linear_truth(ridge, tol):
    model = LinearCostModel(PRIOR, ridge=ridge)
    data = shapes(300)
    for shape in data:
        model.observe(shape, truth(TRUTH, shape))
    worst = max(abs(model.predict(s) - truth(TRUTH, s)) / truth(TRUTH, s) for s in shapes(200, seed=1))
    assert worst < tol
    assert list(model.coefficients.values()) == pytest.approx(TRUTH, rel=50 * tol)
    p50, p99 = model.error_quantiles()
    assert p50 < tol  # the predictions made before each observation were right once it had seen a few


def test_tracks_a_machine_that_gets_twice_as_slow():
    model = LinearCostModel(PRIOR)
    for shape in shapes(300):
        model.observe(shape, truth(TRUTH, shape))
    slower = [2 * c for c in TRUTH]
    errors = []
    for shape in shapes(400, seed=2):
        errors.append(abs(model.predict(shape) - truth(slower, shape)) / truth(slower, shape))
        model.observe(shape, truth(slower, shape))
    assert min(errors[:5]) > 0.4  # it starts at the old speed...
    assert max(errors[-100:]) < 0.02  # ...and follows the new one
    held_out = shapes(100, seed=3)
    assert max(abs(model.predict(s) / truth(slower, s) - 1) for s in held_out) < 0.02


def test_one_outlier_counts_as_one_step_half_again_as_slow():
    """Once settled, a step 50x slower than predicted (another tenant took the core) is learnt as one 1.5x slower:
    the typical prediction moves by about a tenth, not by 50x."""
    model = LinearCostModel(PRIOR)
    data = shapes(300)
    rng = random.Random(5)
    for shape in data:
        model.observe(shape, truth(TRUTH, shape) * (1 + rng.gauss(0, 0.1)))  # 10% measurement noise
    spike, capped = copy.deepcopy(model), copy.deepcopy(model)
    spike.observe(data[0], 50 * truth(TRUTH, data[0]))
    capped.observe(data[0], 1.5 * model.predict(data[0]))
    held_out = shapes(100, seed=6)
    assert [spike.predict(s) for s in held_out] == pytest.approx([capped.predict(s) for s in held_out], rel=1e-9)
    moves = sorted(abs(spike.predict(s) / model.predict(s) - 1) for s in held_out)
    assert moves[50] < 0.15


def test_a_one_go_fit_keeps_the_typical_step_when_a_tenth_are_stretched():
    """A profile fitted on steps of which one in ten another tenant stretched 2-5x: the fit's median prediction
    stays within 10% of the undisturbed truth, where a plain least-squares fit (a mean) sits ~28% above it."""
    rng = random.Random(7)
    data = shapes(400, seed=8)
    observed = [(s, truth(TRUTH, s) * (1 + rng.gauss(0, 0.05)) * (rng.uniform(2, 5) if rng.random() < 0.1 else 1))
                for s in data]
    model = LinearCostModel.fit(observed, PRIOR)
    plain = LinearCostModel._fit_once(observed, PRIOR, "", 1e-12)
    held_out = shapes(200, seed=9)

    def median_ratio(m):
        return sorted(m.predict(s) / truth(TRUTH, s) for s in held_out)[100]

    assert median_ratio(model) == pytest.approx(1.0, abs=0.1)  # 1.08: a clipped step still counts 1.5x
    assert median_ratio(plain) > 1.2  # what the refits are for
    assert model.num_observed == len(observed) and not model.online


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), steps=st.lists(st.tuples(st.integers(0, 10**6), st.floats(1e-6, 10.0)),
                                                   min_size=1, max_size=40))
def test_never_negative_and_never_shrinks_as_a_chunk_grows(seed, steps):
    """Whatever it is fed (times unrelated to the shapes), coefficients stay >= 0: predictions are >= 0 and a
    longer chunk never predicts a shorter step, which the scheduler's search for the largest chunk relies on."""
    model = LinearCostModel(PRIOR)
    for shape_seed, seconds in steps:
        model.observe(random_shape(random.Random(shape_seed)), seconds)
    assert all(c >= 0 for c in model.coefficients.values())
    rng = random.Random(seed)
    for _ in range(20):
        base = random_shape(rng)
        start = rng.randint(0, 2000)
        times = [model.predict(base.with_chunk(start, n, False, False)) for n in (1, 16, 64, 256)]
        assert times[0] >= 0 and times == sorted(times)
    assert model.predict(StepShape()) == 0.0


def test_fixed_profile_for_the_simulator():
    """A profile fitted once, frozen: predictions do not move, errors are still kept (here exactly 0.5)."""
    model = LinearCostModel(PRIOR)
    for shape in shapes(100):
        model.observe(shape, truth(TRUTH, shape))
    frozen = LinearCostModel.from_profile(model.profile(), online=False)
    assert frozen.coefficients == model.coefficients and frozen.key == model.key
    shape = shapes(1, seed=4)[0]
    before = frozen.predict(shape)
    frozen.observe(shape, before * 2)
    frozen.observe(shape, before * 2)
    assert frozen.predict(shape) == before and frozen.error_quantiles() == (0.5, 0.5)
    with pytest.raises(ValueError, match="features"):
        LinearCostModel.from_profile({**model.profile(), "features": ["step"]})
    with pytest.raises(ValueError, match="non-negative"):
        LinearCostModel([-1.0, 0, 0, 0, 0, 0])


def test_error_quantiles_of_known_misses():
    model = LinearCostModel([1.0, 0, 0, 0, 0, 0], online=False)  # predicts 1 s for every step
    one = StepShape().with_chunk(0, 1, True, True)
    assert model.error_quantiles() is None
    for seconds in [1.0] * 98 + [2.0, 4.0]:  # exact 98 times, then 50% and 75% off (|1 - m| / m)
        model.observe(one, seconds)
    p50, p99 = model.error_quantiles()
    assert p50 == 0.0 and p99 == pytest.approx(0.5 + 0.25 * 0.01)  # rank 98.01 of 0..99, interpolated
    model.clear_errors()
    assert model.error_quantiles() is None


def brute_force(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The minimiser over x >= 0, found by trying every free set (KKT: the best feasible unconstrained solve)."""
    n, best = len(g), None
    for k in range(n + 1):
        for free in itertools.combinations(range(n), k):
            x = np.zeros(n)
            if free:
                x[list(free)] = np.linalg.solve(h[np.ix_(free, free)], g[list(free)])
            if (x < -1e-12).any():
                continue
            value = 0.5 * x @ h @ x - g @ x
            if best is None or value < best[0]:
                best = (value, x)
    return best[1]


def test_nonnegative_solver_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = rng.normal(size=(int(rng.integers(1, 12)), 6)) * rng.choice([0.1, 1, 10], size=6)
        h, g = a.T @ a + 1e-6 * np.eye(6), rng.normal(size=6) * 3
        warm = list(rng.choice(6, size=int(rng.integers(0, 7)), replace=False))
        x, _ = _nonnegative_quadratic(h.tolist(), g.tolist(), [int(i) for i in warm])
        x = np.array(x)
        ref = brute_force(h, g)
        assert (x >= 0).all()
        assert 0.5 * x @ h @ x - g @ x == pytest.approx(0.5 * ref @ h @ ref - g @ ref, rel=1e-7, abs=1e-9)
