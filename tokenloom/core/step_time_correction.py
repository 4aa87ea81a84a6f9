"""What the SLO controller learns from measured steps: how far real step times are from the profile's.

A profile (core/cost_model.py) is fitted once, on one machine, with one runner build; the engine that
uses it runs later, with other processes on the CPUs, perhaps a faster kernel, and the shapes the SLO
controller picks (steps sized to just fit the ITL target) are not the grid the profile was fitted on.
So the controller scales its predictions by what it observes: after each executed step the engine
core reports the step's measured seconds next to the prediction for the step *as scheduled*
(`Scheduler.observe_step_time`), and this object keeps, per regime, an exponentially weighted mean of
observed / predicted and its mean absolute deviation:

- **Regimes**: decode-only steps and steps with prefill rows. Their errors differ (a prefill chunk's
  GEMMs against many small decodes' per-row overheads), and one ratio for both would mix them. A
  regime that has not warmed up yet borrows the other's correction, else none (the profile as is).
- **Warm-up**: the first WARMUP ratios of a regime only collect; the correction then starts from their
  median, so the engine's first steps (allocations, caches warming) do not set it.
- **Bounded**: each later ratio is clipped to [mean / CLIP, mean · CLIP] before it enters (a single
  outlier step moves the mean by at most ALPHA · (CLIP - 1), and the deviation likewise), and the mean
  stays in [MIN_FACTOR, MAX_FACTOR].
- **Two factors**: `mean` for sums of many steps (a prompt's predicted first token), `high` = mean +
  SPREAD · deviation for one step against the ITL target, which is a promise for (nearly) every gap:
  aiming the mean at the target would put half the steps over it.

Deterministic: the same observations give the same factors (the simulator reports its virtual step
times, which are the profile's own predictions: every ratio is 1 and nothing changes). Pure Python.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WARMUP = 5  # ratios a regime collects before its correction applies
ALPHA = 0.1  # weight of a new ratio: a shift in the machine's speed is followed within ~10-20 steps
CLIP = 1.5  # a ratio enters clipped to [mean / CLIP, mean * CLIP]
SPREAD = 2.0  # deviations above the mean that a single step is planned for (the ITL check)
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0  # the correction never trusts the profile less than this


@dataclass
class RegimeCorrection:
    """observed / predicted step time in one regime."""

    warmup: list[float] = field(default_factory=list)
    mean: float = 1.0
    deviation: float = 0.0
    num_observed: int = 0

    @property
    def warm(self) -> bool:
        return self.num_observed >= WARMUP

    def observe(self, ratio: float) -> None:
        self.num_observed += 1
        if len(self.warmup) < WARMUP:
            self.warmup.append(ratio)
            if len(self.warmup) == WARMUP:
                mid = statistics.median(self.warmup)
                self.mean = min(max(mid, MIN_FACTOR), MAX_FACTOR)
                self.deviation = statistics.median(abs(r - mid) for r in self.warmup)
            return
        x = min(max(ratio, self.mean / CLIP), self.mean * CLIP)
        self.deviation += ALPHA * (abs(x - self.mean) - self.deviation)
        self.mean = min(max(self.mean + ALPHA * (x - self.mean), MIN_FACTOR), MAX_FACTOR)

    @property
    def high(self) -> float:
        return min(self.mean + SPREAD * self.deviation, MAX_FACTOR)


@dataclass
class StepTimeCorrection:
    decode: RegimeCorrection = field(default_factory=RegimeCorrection)
    prefill: RegimeCorrection = field(default_factory=RegimeCorrection)

    def observe(self, predicted_s: float, observed_s: float, has_prefill: bool) -> None:
        """One executed step: its predicted and measured seconds (ignored unless both are positive)."""
        if predicted_s > 0 and observed_s > 0:
            (self.prefill if has_prefill else self.decode).observe(observed_s / predicted_s)

    def _regime(self, has_prefill: bool) -> RegimeCorrection | None:
        own, other = (self.prefill, self.decode) if has_prefill else (self.decode, self.prefill)
        return own if own.warm else other if other.warm else None

    def mean(self, has_prefill: bool) -> float:
        """The factor for a step counted in a sum of many (its expected time)."""
        r = self._regime(has_prefill)
        return r.mean if r is not None else 1.0

    def high(self, has_prefill: bool) -> float:
        """The factor for one step that must stay within a target."""
        r = self._regime(has_prefill)
        return r.high if r is not None else 1.0

    def summary(self) -> dict[str, float]:
        """For the step trace: the factors in use."""
        return {"decode": round(self.high(False), 4), "prefill": round(self.high(True), 4)}
