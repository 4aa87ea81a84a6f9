"""Step-time cost model: seconds of one engine step as a linear function of the step's shape.

    t = overhead + a·prefill_tokens + b·decode_tokens + g·gemm_rows + c_p·prefill_attn + c_d·decode_attn
        + d·num_seqs + e·num_samples

A row of the step is one scheduled request: `n` tokens starting at position `start`. As in the real
runner (tokenloom/model/runner.py), a one-token row is a decode and every longer row is a prefill chunk.
The attention terms follow how that runner computes attention on this CPU:

* a prefill chunk runs its own attention over its context: Σ_{i=1..n} (start + i) = n·start + n(n+1)/2
  query-key pairs; `num_seqs` carries the per-row cost (one attention call, its mask, its inputs);
* each decode reads its own context, once per layer (the fused CPU kernel walks the block table; no
  padding), so the decode attention work is the sum of the decodes' contexts. Attention there is bound
  by memory traffic, which that sum measures. (The pure-torch path pads decodes in groups of 16–32
  sorted by context, which the sum also approximates well.);
* `gemm_rows`: the runner's pre-packed bf16 GEMMs run at bucketed row counts (tokenloom/model/gemm_rows.py,
  up to 12.5 % padding), so a 260-token step costs what a 288-token one does; the plain token counts stay
  as terms for runners that do not pad (fp32, CUDA);
* only rows that sample go through the LM head and the sampler (a chunk that stops short of its
  sequence's end samples nothing): `num_samples`. A request verifying d draft tokens is a (1 + d)-token
  chunk, as the runner computes it, with 1 + d output rows.

Fitted by least squares on relative error (weights 1/t), so a 5 ms decode step counts as much as a
500 ms prefill step, and with non-negative coefficients (a negative cost per token is an artefact of
collinear samples, and would extrapolate badly).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenloom.model.gemm_rows import packed_rows

TERMS = ("overhead", "prefill_tokens", "decode_tokens", "gemm_rows", "prefill_attn", "decode_attn", "num_seqs",
         "num_samples")


@dataclass
class StepShape:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_attn: int = 0
    decode_max_context: int = 0
    decode_context_sum: int = 0
    num_seqs: int = 0
    num_samples: int = 0

    def add_row(self, start: int, n: int, samples: bool, num_drafts: int = 0) -> None:
        """A row of `n` tokens from `start`; with `num_drafts` drafts to verify it is a chunk whose
        last 1 + num_drafts rows go through the LM head (the runner's verification rows)."""
        self.num_seqs += 1
        self.num_samples += (1 + num_drafts) if samples else 0
        if n == 1:
            self.decode_tokens += 1
            self.decode_context_sum += start + 1
            if start >= self.decode_max_context:
                self.decode_max_context = start + 1
        else:
            self.prefill_tokens += n
            self.prefill_attn += n * start + n * (n + 1) // 2

    @property
    def decode_attn(self) -> int:
        return self.decode_context_sum

    @property
    def gemm_rows(self) -> int:
        """Rows the step's GEMMs really compute: all its tokens, padded as the runner pads them."""
        return packed_rows(self.prefill_tokens + self.decode_tokens)

    def features(self) -> tuple[float, ...]:
        """Values in TERMS order (the overhead's feature is 1)."""
        return (1.0, self.prefill_tokens, self.decode_tokens, self.gemm_rows, self.prefill_attn, self.decode_attn,
                self.num_seqs, self.num_samples)  # fmt: skip

    @staticmethod
    def of_rows(rows: Iterable[tuple[int, int, bool]]) -> StepShape:
        shape = StepShape()
        for start, n, samples in rows:
            shape.add_row(start, n, samples)
        return shape


@dataclass
class FitError:
    mape: float  # mean |predicted - measured| / measured
    max_ape: float
    r2: float
    num_samples: int


@dataclass
class CostModel:
    """Seconds per unit of each term (missing terms are 0)."""

    coefficients: dict[str, float]

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown cost-model term(s): {', '.join(sorted(unknown))}; known: {', '.join(TERMS)}")
        self._coef = tuple(float(self.coefficients.get(t, 0.0)) for t in TERMS)

    def predict(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self._coef, shape.features(), strict=True))


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
