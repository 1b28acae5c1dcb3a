"""Predicted step time from the step's shape, calibrated online from the engine's own measured steps.

The scheduler sizes a step's prompt share by time (scheduler.py): with streams decoding, it admits the most
prompt tokens whose predicted step time stays within the target ITL. It asks `predict(shape)` while it fills
the step; the engine calls `observe(shape, seconds)` after the step with what it measured. The planner's
simulator can drive the scheduler with the same class and a fixed, offline-fitted profile
(`LinearCostModel.from_profile(..., online=False)`): whatever implements `StepCostModel` will do.

The model is linear in six features of the step (`StepShape.features`): a constant (weights read once, per-step
dispatch), prompt rows and the (query, key) pairs they attend (the linears, the prefill attention), decode rows
and the context they read (the linears at small M, the KV streamed), and sampled rows (the vocabulary matmul,
the sampler). Coefficients are kept non-negative, so a prediction never falls when a chunk grows and is never
negative. `LinearCostModel` fits them by least squares with exponential forgetting (the normal equations
decay by `forgetting` per observation, so the fit follows a machine whose speed drifts), each solve a small
non-negative least-squares problem (Lawson-Hanson) regularised lightly towards the prior, so that a feature the
recent steps did not vary (no prompt chunk for a minute) keeps its prior value instead of an arbitrary one.
The prior is a roofline guess, refined by the start-up probe (engine/cost_probe.py). An observation more than 1.5x
off the prediction (another tenant took the core for 300 ms) is learnt as if it were 1.5x off, so one outlier cannot
swing the fit; a one-go fit for a profile (`fit`) applies the same rule by refitting. The forgetting factor (0.95:
the last ~20 steps weigh most, well under a second of serving) was chosen on recorded steps of a shared 2-core
machine, where faster forgetting followed the other tenants' load better (median online error 0.19 at 0.95 against
0.22 at 0.98 and 0.25 at 0.995).

It also keeps the relative error |predicted - measured| / measured of its recent predictions (made before each
observation was learned), for /metrics and the benchmarks. No torch and no clock here: time is what the caller
measured.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


FEATURES = ("step", "prefill_tokens", "prefill_attention", "decode_tokens", "decode_context", "sampled")
UNITS = ("s", "s/token", "s/pair", "s/token", "s/context token", "s/row")
# Feature scales for the fit (a typical step has each scaled feature near 1), so the regulariser weighs alike.
_SCALES = (1.0, 1e3, 1e6, 1e2, 1e5, 1e2)
_N = len(FEATURES)
# Observations after which a step far off the prediction is learnt as if 1.5x off: the start-up probe's six steps
# (engine/cost_probe.py). It was 20: a server's first real steps were learnt whole, and one 470 ms decode step (a
# core taken by the API process) set the constant to 65 ms and the prompt-token cost to 0, so the next step put a
# 2,047-token prompt beside a stream as a 65 ms step; it took 744 ms.
SETTLED = 6
# How far off the prediction a step may be before it is learnt as if it were only this far off.
OUTLIER = 1.5
# Refits of a one-go fit, each with the steps clipped to OUTLIER of the previous fit (three settle it).
REFITS = 3


@dataclass(slots=True)
class StepShape:
    """What a step computes, as the cost model sees it; a value (with_chunk returns a new one)."""

    prefill_tokens: int = 0  # rows of prompt (or recompute) chunks
    prefill_attention: int = 0  # (query, key) pairs those rows attend: n * start + n (n + 1) / 2 per chunk
    decode_tokens: int = 0  # decode rows: one per stream (more where a grammar forced tokens)
    decode_context: int = 0  # the context those rows read, summed
    sampled: int = 0  # rows through the vocabulary matmul and the sampler (a verify chunk: 1 + its drafts)
    # Speculation's verify rows beyond a stream's decode row: its draft tokens. They ride on the context the decode
    # row reads, as a short prompt chunk does (more query rows over the same keys), so the model prices them with
    # the prompt features; they are kept apart here so a step's plain-decode twin can be priced too.
    draft_tokens: int = 0
    draft_attention: int = 0  # (query, key) pairs the draft rows attend

    def with_chunk(self, start: int, num_tokens: int, is_decode: bool, samples: bool | int,
                   num_draft: int = 0) -> StepShape:
        """This shape plus one chunk: tokens [start, start + num_tokens) of a request, each attending its prefix; the
        last num_draft of them draft tokens (then the chunk samples 1 + num_draft rows)."""
        n = num_tokens - num_draft
        pairs = n * start + n * (n + 1) // 2
        rows = int(samples) + (num_draft if samples else 0)
        d_pairs = num_draft * (start + n) + num_draft * (num_draft + 1) // 2
        if is_decode:
            return StepShape(self.prefill_tokens, self.prefill_attention, self.decode_tokens + n,
                             self.decode_context + pairs, self.sampled + rows, self.draft_tokens + num_draft,
                             self.draft_attention + d_pairs)
        return StepShape(self.prefill_tokens + n, self.prefill_attention + pairs, self.decode_tokens,
                         self.decode_context, self.sampled + rows, self.draft_tokens + num_draft,
                         self.draft_attention + d_pairs)

    @classmethod
    def from_chunks(cls, chunks: Iterable) -> StepShape:
        """From the scheduler's chunks (anything with start, num_tokens, is_decode and samples; num_draft if any)."""
        counts = [0, 0, 0, 0, 0, 0, 0]
        for c in chunks:
            d = getattr(c, "num_draft", 0)
            n = c.num_tokens - d
            i = 2 if c.is_decode else 0
            counts[i] += n
            counts[i + 1] += n * c.start + n * (n + 1) // 2
            counts[4] += c.samples + (d if c.samples else 0)
            counts[5] += d
            counts[6] += d * (c.start + n) + d * (d + 1) // 2
        return cls(*counts)

    def without_drafts(self) -> StepShape:
        """The same step with every stream decoding plainly: no draft rows (what the step costs without speculation)."""
        return StepShape(self.prefill_tokens, self.prefill_attention, self.decode_tokens, self.decode_context,
                         self.sampled - self.draft_tokens)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens + self.draft_tokens

    def features(self) -> tuple[float, ...]:
        """The model's inputs, in FEATURES order; an empty step has none."""
        if not self.num_tokens:
            return (0.0,) * _N
        return (1.0, float(self.prefill_tokens + self.draft_tokens), float(self.prefill_attention + self.draft_attention),
                float(self.decode_tokens), float(self.decode_context), float(self.sampled))


class StepCostModel(Protocol):
    """What the scheduler needs: a step's predicted seconds; what the engine gives back: the measured ones."""

    def predict(self, shape: StepShape) -> float: ...

    def observe(self, shape: StepShape, seconds: float) -> None: ...


class LinearCostModel:
    """seconds = sum(coefficient_i * feature_i), coefficients >= 0, fitted online (see the module docstring).

    `prior`: coefficients in FEATURES order (natural units: UNITS), the fit's starting point and regularisation
    target. `online=False` keeps them fixed (a profile for the simulator) while still tracking the error.
    `key` names what the coefficients hold for (e.g. "cpu/bfloat16"): a profile fitted on one device and dtype
    means nothing on another. Plain Python floats throughout: for a 6 x 6 system, numpy's per-call overhead cost
    more than the arithmetic (an observation took ~250 us with numpy, a tenth of a small decode step).
    """

    def __init__(self, prior: Sequence[float], *, key: str = "", online: bool = True, forgetting: float = 0.95,
                 ridge: float = 1e-6, error_window: int = 512):
        if len(prior) != _N or any(not (c >= 0 and math.isfinite(c)) for c in prior):
            raise ValueError(f"prior needs {_N} finite non-negative coefficients ({', '.join(FEATURES)})")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.key = key
        self.online = online
        self.forgetting = forgetting
        self.ridge = ridge
        self._prior = [float(c) * k for c, k in zip(prior, _SCALES)]  # in scaled units
        self._coef_list = [float(c) for c in prior]  # natural units
        self._gram = [[0.0] * _N for _ in range(_N)]  # sum of x x^T over observations (scaled x), decayed
        self._rhs = [0.0] * _N  # sum of x * y, decayed
        self._passive: list[int] = [i for i in range(_N) if self._prior[i] > 0]
        self.num_observed = 0
        self._errors: deque[float] = deque(maxlen=error_window)

    # -- the interface --------------------------------------------------------------------------
    def predict(self, shape: StepShape) -> float:
        """Seconds the step should take (never negative; 0 for an empty step)."""
        if not shape.num_tokens:
            return 0.0
        c = self._coef_list
        return max(0.0, c[0] + c[1] * (shape.prefill_tokens + shape.draft_tokens)
                   + c[2] * (shape.prefill_attention + shape.draft_attention)
                   + c[3] * shape.decode_tokens + c[4] * shape.decode_context + c[5] * shape.sampled)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learn one measured step (seconds, > 0); the error of the prediction made before it is recorded."""
        if not shape.num_tokens or not seconds > 0 or not math.isfinite(seconds):
            return
        predicted = self.predict(shape)
        self._errors.append(abs(predicted - seconds) / seconds)
        self.num_observed += 1
        if not self.online:
            return
        # Once the fit has settled (the start-up probe's steps are enough), a step far off the prediction (another
        # tenant took the core, a page-fault storm) is learnt as if it had been only 1.5x off: one outlier moves the
        # fit like one ordinary step, while a machine that really got slower still pulls the fit its way.
        if self.num_observed > SETTLED and predicted > 0:
            seconds = _clip(seconds, predicted)
        self._accumulate(shape, seconds)
        self._fit()

    # -- what it knows --------------------------------------------------------------------------
    @property
    def coefficients(self) -> dict[str, float]:
        """Fitted coefficients by feature name, in UNITS."""
        return dict(zip(FEATURES, self._coef_list))

    def error_quantiles(self) -> tuple[float, float] | None:
        """(p50, p99) of |predicted - measured| / measured over the recent observations; None before any."""
        if not self._errors:
            return None
        errors = sorted(self._errors)
        return _quantile(errors, 0.5), _quantile(errors, 0.99)

    def clear_errors(self) -> None:
        """Forget the recorded errors (not the fit): after a warm-up whose misses would only mislead."""
        self._errors.clear()

    def profile(self) -> dict:
        """The fitted model as plain data (JSON-ready), for from_profile."""
        return {"key": self.key, "features": list(FEATURES), "units": list(UNITS),
                "coefficients": list(self._coef_list), "observations": self.num_observed}

    @classmethod
    def from_profile(cls, profile: dict, *, online: bool = False, **options) -> LinearCostModel:
        if list(profile.get("features", [])) != list(FEATURES):
            raise ValueError(f"a profile for features {profile.get('features')}, not {list(FEATURES)}")
        model = cls(profile["coefficients"], key=profile.get("key", ""), online=online, **options)
        model.num_observed = int(profile.get("observations", 0))  # what the fit has seen, where it was fitted
        return model

    @classmethod
    def fit(cls, observations: Iterable[tuple[StepShape, float]], prior: Sequence[float], *, key: str = "",
            ridge: float = 1e-12) -> LinearCostModel:
        """One fit over every (shape, seconds) at once, none forgotten: a fixed profile from a calibration sweep
        or a recorded run (plan/). The same non-negative least squares the online model solves after each step,
        with a lighter pull towards the prior (`ridge`: a sweep varies every feature, the prior only breaks ties).
        Then REFITS more, each with the steps clipped to OUTLIER of the last fit: the online model's outlier rule.
        Without it a few steps that another tenant stretched 3x pull a plain least-squares fit (a mean) above the
        typical step, and a simulator driven by it put the median ITL 35-50% above the recorded run's."""
        seen = [(shape, seconds) for shape, seconds in observations
                if shape.num_tokens and seconds > 0 and math.isfinite(seconds)]
        model = cls._fit_once(seen, prior, key, ridge)
        for _ in range(REFITS if seen else 0):
            model = cls._fit_once([(shape, _clip(seconds, model.predict(shape))) for shape, seconds in seen],
                                  prior, key, ridge)
        return model

    @classmethod
    def _fit_once(cls, seen: list[tuple[StepShape, float]], prior: Sequence[float], key: str,
                  ridge: float) -> LinearCostModel:
        model = cls(prior, key=key, online=False, forgetting=1.0, ridge=ridge)
        for shape, seconds in seen:
            model._accumulate(shape, seconds)
        model.num_observed = len(seen)
        if seen:
            model._fit()
        return model

    # -- the fit ---------------------------------------------------------------------------------
    def _accumulate(self, shape: StepShape, seconds: float) -> None:
        """Add one observation to the normal equations, the older ones decayed by the forgetting factor."""
        x = [f / k for f, k in zip(shape.features(), _SCALES)]
        lam = self.forgetting
        for i in range(_N):
            row, xi = self._gram[i], x[i]
            for j in range(_N):
                row[j] = lam * row[j] + xi * x[j]
            self._rhs[i] = lam * self._rhs[i] + xi * seconds

    def _fit(self) -> None:
        """min ||X c - y||^2 + ridge ||c - prior||^2 over c >= 0, as a bound-constrained quadratic."""
        r = self.ridge * max(1.0, sum(self._gram[i][i] for i in range(_N)) / _N)
        hessian = [[v + (r if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._gram)]
        gradient = [b + r * p for b, p in zip(self._rhs, self._prior)]
        coef, self._passive = _nonnegative_quadratic(hessian, gradient, self._passive)
        self._coef_list = [c / k for c, k in zip(coef, _SCALES)]


def _clip(seconds: float, predicted: float) -> float:
    """A measured step learnt as if at most OUTLIER off the prediction (as measured where nothing is predicted)."""
    return min(max(seconds, predicted / OUTLIER), OUTLIER * predicted) if predicted > 0 else seconds


def _solve(h: list[list[float]], g: list[float], free: list[int]) -> list[float]:
    """x with x[free] = h[free, free]^-1 g[free] (Cholesky: h is positive definite), 0 elsewhere."""
    m = len(free)
    low = [[0.0] * m for _ in range(m)]
    for a in range(m):
        la, ha = low[a], h[free[a]]
        for b in range(a + 1):
            lb, v = low[b], ha[free[b]]
            for k in range(b):
                v -= la[k] * lb[k]
            la[b] = math.sqrt(v if v > 1e-300 else 1e-300) if a == b else v / lb[b]
    y = [0.0] * m
    for a in range(m):
        v, la = g[free[a]], low[a]
        for k in range(a):
            v -= la[k] * y[k]
        y[a] = v / la[a]
    for a in reversed(range(m)):
        v = y[a]
        for k in range(a + 1, m):
            v -= low[k][a] * y[k]
        y[a] = v / low[a][a]
    x = [0.0] * len(g)
    for a, i in enumerate(free):
        x[i] = y[a]
    return x


def _nonnegative_quadratic(h: list[list[float]], g: list[float], passive: list[int]) -> tuple[list[float], list[int]]:
    """argmin 1/2 x^T h x - g^T x subject to x >= 0, h positive definite: Lawson and Hanson's NNLS on the normal
    equations, warm-started from the last fit's free set `passive`. Returns (x, its free set)."""
    n = len(g)
    free = sorted(passive)
    x = _solve(h, g, free)
    if any(x[i] <= 0 for i in free):  # the old free set no longer fits: start from nothing free
        free, x = [], [0.0] * n
    tol = 1e-12 * max(1.0, max(abs(v) for v in g))
    for _ in range(3 * n):  # a few iterations in practice; bounded against round-off cycling
        w = [gi - sum([hij * xj for hij, xj in zip(hi, x)]) for gi, hi in zip(g, h)]  # minus the gradient
        fixed = [i for i in range(n) if i not in free and w[i] > tol]  # freeing one would lower the objective
        if not fixed:
            break
        free = sorted([*free, max(fixed, key=lambda i: w[i])])
        for _ in range(3 * n):
            s = _solve(h, g, free)
            if all(s[i] > 0 for i in free):
                x = s
                break
            # walk from x towards s until the first free variable reaches 0, and fix it there
            alpha = min((x[i] / (x[i] - s[i]) for i in free if s[i] <= 0 < x[i] - s[i]), default=0.0)
            x = [xi + alpha * (si - xi) for xi, si in zip(x, s)]
            floor = 1e-12 * max(abs(v) for v in x)  # round-off leaves the variable that hit 0 at ~1e-300
            free = [i for i in free if x[i] > floor]
            x = [xi if i in free else 0.0 for i, xi in enumerate(x)]
    return [max(v, 0.0) for v in x], free


def _quantile(sorted_values: list[float], q: float) -> float:
    k = (len(sorted_values) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo))
