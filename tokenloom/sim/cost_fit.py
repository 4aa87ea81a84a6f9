"""Fitting the step-time cost model to profiled steps (numpy); the model itself, which predicts a step, is
tokenloom/core/cost_model.py.

Least squares on relative error (weights 1/t), so a 5 ms decode step counts as much as a 500 ms
prefill step, and with non-negative coefficients (a negative cost per token is an artefact of
collinear samples, and would extrapolate badly). The model itself (terms, step shapes, prediction)
lives in tokenloom/core, where the scheduler's SLO budget controller uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenloom.core.cost_model import TERMS, CostModel, StepShape


@dataclass
class FitError:
    mape: float  # mean |predicted - measured| / measured
    max_ape: float
    r2: float
    num_samples: int


@dataclass
class Sample:
    """One profiled step: its shape and the measured seconds (a median over repeats)."""

    shape: StepShape
    seconds: float


def fit(samples: Sequence[Sample], terms: Sequence[str] = TERMS) -> tuple[CostModel, FitError]:
    """Non-negative least squares on relative error, by dropping negative terms and refitting.

    With six terms the active-set loop ends after a few refits; it is plain numpy (no scipy).
    """
    if not samples:
        raise ValueError("no samples to fit")
    index = [TERMS.index(t) for t in terms]
    x_all = np.array([s.shape.features() for s in samples], dtype=float)[:, index]
    y = np.array([s.seconds for s in samples], dtype=float)
    if np.any(y <= 0):
        raise ValueError("measured step times must be > 0")
    weights = 1.0 / y
    active = list(range(len(index)))
    while True:
        x = x_all[:, active] * weights[:, None]
        coef, *_ = np.linalg.lstsq(x, y * weights, rcond=None)
        negative = [a for a, c in zip(active, coef) if c < 0]
        if not negative:
            break
        # Drop the most negative one and refit: the others shift once it is gone.
        worst = active[int(np.argmin(coef))]
        active.remove(worst)
    coefficients = {t: 0.0 for t in terms}
    for a, c in zip(active, coef):
        coefficients[terms[a]] = float(c)
    model = CostModel(coefficients)
    return model, fit_error(model, samples)


def fit_error(model: CostModel, samples: Sequence[Sample]) -> FitError:
    y = np.array([s.seconds for s in samples], dtype=float)
    pred = np.array([model.predict(s.shape) for s in samples], dtype=float)
    ape = np.abs(pred - y) / y
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return FitError(mape=float(ape.mean()), max_ape=float(ape.max()), r2=r2, num_samples=len(samples))
