"""The step-time cost model itself, pure Python (predicting a step; used by the scheduler and the simulator);
sim/cost_fit.py only fits it to profiled steps (numpy).

Seconds of one engine step as a linear function of the step's shape:

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
* `gemm_rows`: the runner's pre-packed bf16 GEMMs run at bucketed row counts (tokenloom/core/gemm_rows.py,
  up to 12.5 % padding), so a 260-token step costs what a 288-token one does; the plain token counts stay
  as terms for runners that do not pad (fp32, CUDA);
* only rows that sample go through the LM head and the sampler (a chunk that stops short of its
  sequence's end samples nothing): `num_samples`. A request verifying d draft tokens is a (1 + d)-token
  chunk, as the runner computes it, with 1 + d output rows.

Pure Python and below the engine (tokenloom/core), so that the scheduler's SLO budget controller
(core/slo_budget.py) predicts a candidate step with the same model the simulator runs. The fit
(least squares on profiled steps, numpy) stays in tokenloom/sim/cost_fit.py; a profile's JSON is
read here only as far as the step model (`load_step_cost_model`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloom.config import ConfigError
from tokenloom.core.gemm_rows import packed_rows

TERMS = ("overhead", "prefill_tokens", "decode_tokens", "gemm_rows", "prefill_attn", "decode_attn", "num_seqs",
         "num_samples")


PROFILE_FORMAT = "tokenloom-sim-profile/1"


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

    def decode_part(self) -> StepShape:
        """The step without its prefill rows: its decodes (each a row that samples) and its overhead."""
        return StepShape(decode_tokens=self.decode_tokens, decode_max_context=self.decode_max_context,
                         decode_context_sum=self.decode_context_sum, num_seqs=self.decode_tokens,
                         num_samples=min(self.decode_tokens, self.num_samples))

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

    def plus(self, extra: dict[str, float]) -> CostModel:
        """This model with `extra` seconds added per unit of some terms (a profile's scheduler overhead)."""
        terms = dict(self.coefficients)
        for term, seconds in extra.items():
            terms[term] = terms.get(term, 0.0) + float(seconds)
        return CostModel(terms)


def step_cost_model(profile: dict[str, Any]) -> CostModel:
    """What one engine step costs according to a profile's JSON: the runner's fit plus the scheduler's
    own overhead (the simulator's `Profile.step_model`)."""
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        found = profile.get("format") if isinstance(profile, dict) else type(profile).__name__
        raise ValueError(f"not a tokenloom profile (format {found!r}, expected {PROFILE_FORMAT!r})")
    return CostModel(dict(profile["coefficients_s"])).plus(dict(profile.get("scheduler_overhead_s", {})))


def load_step_cost_model(path: str | Path) -> CostModel:
    """The step model of a profile file (`tokenloom profile` writes one; the shipped ones are in
    tokenloom/sim/profiles/)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"step_cost_profile {str(path)!r}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"step_cost_profile {str(path)!r}: not JSON ({exc.msg})") from None
    try:
        return step_cost_model(data)
    except (KeyError, ValueError, TypeError) as exc:
        raise ConfigError(f"step_cost_profile {str(path)!r}: {exc}") from None
