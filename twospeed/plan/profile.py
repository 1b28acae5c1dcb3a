"""A calibrated step profile: the engine's six-feature cost model fitted on one machine, and what its pool holds.

`twospeed plan calibrate` (plan/calibrate.py) times real engine steps over a sweep of shapes and fits
engine/cost_model.py's linear model to them in one go (`LinearCostModel.fit`, the same non-negative least squares
the engine refits online): seconds = a + b*prompt tokens + c*(query, key) pairs + d*decode rows + e*context they
read + f*sampled rows, the issue's a + b*sum(l) + c*sum(l*ctx) for prefill and a + b*sum(ctx) + c*batch for
decode in one model. The profile keeps the residuals (|predicted - measured| / measured, by kind of step) beside
the coefficients, so a plan says how far its step times can be trusted, and the engine's memory facts (block
size, blocks, KV bytes per token, weight bytes, max_model_len) so the simulator's pool is the calibrated one.

The file is JSON: {"kind": "twospeed-step-profile", "version": 1, "key", "features", "units", "coefficients",
"residuals", "engine", "sweep", "created_at", "model"}. No torch here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from twospeed.engine.cost_model import FEATURES, UNITS, LinearCostModel, StepShape

KIND = "twospeed-step-profile"
VERSION = 1


def step_kind(shape: StepShape) -> str:
    """prefill (prompt chunks only), decode (decodes only) or mixed."""
    if shape.prefill_tokens and shape.decode_tokens:
        return "mixed"
    return "prefill" if shape.prefill_tokens else "decode"


def residuals(model: LinearCostModel, observations: Sequence[tuple[StepShape, float]]) -> dict:
    """Relative error |predicted - measured| / measured by kind of step (and "all"): n, p50, p90, p99, max."""
    by_kind: dict[str, list[float]] = {"all": []}
    for shape, seconds in observations:
        err = abs(model.predict(shape) - seconds) / seconds
        by_kind["all"].append(err)
        by_kind.setdefault(step_kind(shape), []).append(err)
    return {kind: _quantiles(errs) for kind, errs in by_kind.items()}


def _quantiles(values: list[float]) -> dict:
    v = sorted(values)

    def q(p: float) -> float | None:
        if not v:
            return None
        k = (len(v) - 1) * p
        lo = math.floor(k)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (k - lo)

    return {"n": len(v), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": v[-1] if v else None}


@dataclass(slots=True)
class Profile:
    """A fitted step profile and the engine it was fitted on."""

    key: str  # device/dtype the coefficients hold for
    coefficients: list[float]  # in FEATURES order, UNITS
    residuals: dict = field(default_factory=dict)  # by step kind: n, p50, p90, p99, max of the relative error
    engine: dict = field(default_factory=dict)  # block_size, num_blocks, max_model_len, kv_bytes_per_token, ...
    sweep: dict = field(default_factory=dict)  # the shapes timed
    model: str = ""  # the checkpoint it was fitted on
    created_at: str = ""

    def cost_model(self) -> LinearCostModel:
        """The fixed cost model (online=False): the simulator's scheduler and its step timer."""
        return LinearCostModel.from_profile(self.as_dict(), online=False)

    def as_dict(self) -> dict:
        return {"kind": KIND, "version": VERSION, "model": self.model, "key": self.key, "features": list(FEATURES),
                "units": list(UNITS), "coefficients": list(self.coefficients), "residuals": self.residuals,
                "engine": self.engine, "sweep": self.sweep, "created_at": self.created_at}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"profile {path}: {e}") from None
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise ValueError(f"profile {path}: not a twospeed step profile (twospeed plan calibrate writes one)")
        if list(doc.get("features", [])) != list(FEATURES) or len(doc.get("coefficients", [])) != len(FEATURES):
            raise ValueError(f"profile {path}: fitted for features {doc.get('features')}, not {list(FEATURES)}")
        return cls(doc.get("key", ""), [float(c) for c in doc["coefficients"]], doc.get("residuals", {}),
                   doc.get("engine", {}), doc.get("sweep", {}), doc.get("model", ""), doc.get("created_at", ""))

    @classmethod
    def fitted(cls, observations: Sequence[tuple[StepShape, float]], prior: Sequence[float], key: str,
               check: Sequence[tuple[StepShape, float]] | None = None, **fields) -> Profile:
        """Fit the cost model to the observations in one go; its residuals on `check` (default: the same)."""
        model = LinearCostModel.fit(observations, prior, key=key)
        return cls(key, list(model.coefficients.values()), residuals(model, check or observations), **fields)


def median_by_shape(observations: Sequence[tuple[StepShape, float]]) -> list[tuple[StepShape, float]]:
    """One observation per distinct shape, its median time: a step disturbed by another tenant counts once at most."""
    groups: dict[tuple, list[float]] = {}
    shapes: dict[tuple, StepShape] = {}
    for shape, seconds in observations:
        key = shape.features()
        groups.setdefault(key, []).append(seconds)
        shapes[key] = shape
    return [(shapes[k], sorted(v)[len(v) // 2]) for k, v in groups.items()]
