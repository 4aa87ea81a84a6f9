"""What the SLO controller learns from measured steps: how far real step times are from the profile's.

A profile (core/cost_model.py) is fitted once, on one machine, with one runner build; the engine that
uses it runs later, with other processes on the CPUs, perhaps a faster kernel, and the shapes the SLO
controller picks (steps sized to just fit the ITL target) are not the grid the profile was fitted on.
So the controller scales its predictions by what it observes: after each executed step the engine
core reports the step's measured seconds next to the prediction for the step *as scheduled*
(`Scheduler.observe_step_time`), and this object keeps, per part of a step, an exponentially weighted
mean of observed / predicted and its mean absolute deviation:

- **Two parts**: a step's decode rows with its fixed overhead, and what its prefill rows add. Their
  errors differ (a prefill chunk's GEMMs against many small decodes' per-row costs; a faster decode
  kernel changes one only), so each has its factor: decode-only steps measure the first, the other
  steps what is left of them once the decode part is accounted for. A factor that has not warmed up
  yet borrows the other's, else none (the profile as is).
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
    """Two factors: `decode` for a step's decode rows with the step's fixed overhead (learnt from
    decode-only steps), `prefill` for what the prefill rows add on top (learnt from the other steps,
    once the decode factor is known: (observed - decode factor x decode part) / prefill part). A
    constant error on every term gives the same factor to both; a runner whose decodes got faster
    (or a profile that misjudges prefill) moves one of them only."""

    decode: RegimeCorrection = field(default_factory=RegimeCorrection)
    prefill: RegimeCorrection = field(default_factory=RegimeCorrection)

    def observe(self, predicted_s: float, decode_s: float, observed_s: float) -> None:
        """One executed step: the profile's seconds for it and for its decode part (rows of one token
        plus the overhead; = predicted_s without prefill rows), and its measured seconds. Ignored
        unless the prediction and the measurement are positive."""
        if predicted_s <= 0 or observed_s <= 0:
            return
        prefill_s = predicted_s - decode_s
        if prefill_s <= 0:
            self.decode.observe(observed_s / predicted_s)
        elif self.decode.warm:
            self.prefill.observe((observed_s - self.decode.mean * decode_s) / prefill_s)
        else:  # no decode factor yet: the whole step's ratio stands for the prefill part's
            self.prefill.observe(observed_s / predicted_s)

    def factors(self, high: bool) -> tuple[float, float]:
        """(decode, prefill) factors; a regime not warm yet borrows the other's, else none (1)."""
        d, p = self.decode, self.prefill
        fd = (d.high if high else d.mean) if d.warm else None
        fp = (p.high if high else p.mean) if p.warm else None
        if fd is None and fp is None:
            return 1.0, 1.0
        return (fd if fd is not None else fp), (fp if fp is not None else fd)  # type: ignore[return-value]

    def seconds(self, predicted_s: float, decode_s: float, high: bool) -> float:
        """A prediction corrected: `high` for one step held to a target (mean + SPREAD deviations),
        else its expected time (for sums of many steps)."""
        fd, fp = self.factors(high)
        if fd == fp:
            return predicted_s * fd
        return decode_s * fd + (predicted_s - decode_s) * fp

    def summary(self) -> dict[str, float]:
        """For the step trace: the one-step factors in use."""
        fd, fp = self.factors(high=True)
        return {"decode": round(fd, 4), "prefill": round(fp, 4)}
