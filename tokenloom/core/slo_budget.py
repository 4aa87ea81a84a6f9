"""SLO-driven token budget (--target-itl-ms, --target-ttft-ms): one job, the step's token budget.

`max_num_batched_tokens` trades inter-token latency against time to first token, and users pick it
by hand (vLLM RFC #52906). This controller picks it per step instead, within `max_num_batched_tokens`
as the ceiling, from the same step-time cost model the simulator runs (core/cost_model.py):

- ITL target (required): the largest budget whose predicted step time stays under the target while
  requests are decoding (a step without decodes has no inter-token gap at stake: the ceiling). Never
  below the decodes' own tokens: a decode is never pushed out of a step by this controller.
- TTFT target (optional, with the ITL one): the ITL target is read as a p99 promise. While fewer than
  ITL_MISS_SHARE of the decodes' gaps so far were predicted over it, one step's budget may go past the
  ITL budget, to the smallest one with which every prompt that can still get its first token within
  the TTFT target (this step at the ceiling, the next ones at the ITL budget) is predicted to. A
  prompt that would miss it even so never raises the budget: that would cost the decodes and save
  nobody. (A TTFT target alone is refused:
  the ceiling already gives the earliest first tokens; there is nothing to trade.)
- Decodes alone over the ITL target: the step misses it whatever the budget, and the ITL budget leaves
  prompts nothing. Such misses are not the controller's choice and do not spend the allowance; with a
  TTFT target a prompt is fed once it would otherwise miss it (the next steps counted at the ceiling,
  since each may act again), instead of waiting for the decodes to finish.

Predictions are corrected by measured step times (core/step_time_correction.py): the engine core
reports each executed step's time (Scheduler.observe_step_time) next to the profile's prediction for
the step as scheduled (predict_raw). A step held to the ITL target is planned with the correction's
high factor, first-token times with its mean. Not with the predicted clock (the profile alone).

A candidate budget is predicted by walking the step as the scheduler will build it (running requests
in order, then waiting ones while sequence slots are free, each chunk capped by the long-prefill
threshold and the budget left), without KV allocation and without prefix-cache hits. A prompt's
predicted first token: its age, plus this step, plus the steps at the ITL budget that the prompt work
ahead of it and its own still needs. Ages come from the scheduler's clock (`slo_clock="engine"`: wall
time in the engine, virtual time in the simulator) or, deterministic in replays, from the sum of the
predicted times of the steps scheduled so far (`slo_clock="predicted"`).

The long-prefill threshold is left as configured: the budget left to prefills is what the controller
sets, and giving it to the oldest prompt first (what the scheduler does without a threshold) is what
minimises the predicted first-token times it checks.

Pure Python, like the rest of tokenloom/core.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.cost_model import CostModel, StepShape
from tokenloom.core.outputs import SchedulerOutput
from tokenloom.core.policies import StepContext, StepPolicy
from tokenloom.core.request import Request
from tokenloom.core.step_time_correction import StepTimeCorrection


@dataclass
class _Row:
    """One request's candidate work this step: `need` tokens from `start`, the sequence ending at `end`."""

    start: int
    need: int
    end: int
    decoding: bool  # it has produced tokens and its next one is a decode: that latency is an ITL
    prompt: bool  # no first token yet: TTFT at stake
    age: float


# The ITL target is a p99 promise: at most this share of the decodes' predicted gaps may exceed it, and
# only to save a first token that would otherwise miss the TTFT target.
ITL_MISS_SHARE = 0.01


@dataclass
class SloBudgetController(StepPolicy):
    cost_model: CostModel
    ceiling: int  # max_num_batched_tokens
    target_itl_s: float
    target_ttft_s: float  # 0: no TTFT target
    predicted_clock: bool  # ages from predicted step times (deterministic) instead of the scheduler's clock
    # The predicted clock: seconds of the steps scheduled so far, and each request's arrival on it.
    predicted_now: float = 0.0
    arrival: dict[str, float] = field(default_factory=dict)
    # Decode gaps scheduled so far, and those in steps predicted over the ITL target.
    num_gaps: int = 0
    num_gaps_over: int = 0
    # Measured step times against predicted ones (core/step_time_correction.py); only with the engine
    # clock: the predicted clock is the profile's word alone, deterministic wherever it runs.
    correction: StepTimeCorrection = field(default_factory=StepTimeCorrection)

    # The policy's hooks (core/policies.py StepPolicy) -------------------------------------------
    def arrived(self, request_id: str, step: int = 0) -> None:
        self.arrival[request_id] = self.predicted_now

    def freed(self, request_id: str) -> None:
        self.arrival.pop(request_id, None)

    def budget(self, ctx: StepContext, budget: int) -> int:
        decided, why = self.decide(ctx.now, ctx.running, ctx.admissible_waiting(), ctx.threshold, ctx.free_slots())
        if why is not None:
            ctx.actions["slo_budget"] = why
        return min(budget, decided)

    def scheduled(self, ctx: StepContext, output: SchedulerOutput) -> None:
        """The profile's seconds for the step as scheduled (frontiers not advanced yet), as the runner
        computes it: a row samples when it reaches its sequence's end, drafts included."""
        if not output.total_num_scheduled_tokens:
            return
        shape = StepShape()
        for rid, n in output.num_scheduled_tokens.items():
            r = ctx.requests[rid]
            num_drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            shape.add_row(r.num_computed_tokens, n, r.num_computed_tokens + n >= r.num_tokens + num_drafts, num_drafts)
        output.predicted_step = self.predict_raw(shape)

    def step_done(self, output: SchedulerOutput, seconds: float) -> None:
        if output.predicted_step is not None:
            self.observe_step(output.predicted_step, seconds)

    # What executed steps cost ------------------------------------------------------------------
    def predict_raw(self, shape: StepShape) -> tuple[float, float]:
        """The profile's seconds for a step as scheduled, and for its decode part (what observe_step
        compares with)."""
        total = self.cost_model.predict(shape)
        return total, self.cost_model.predict(shape.decode_part()) if shape.prefill_tokens else total

    def observe_step(self, predicted: tuple[float, float], observed_s: float) -> None:
        """A step executed: `observed_s` measured where `predicted` (predict_raw) was expected."""
        if not self.predicted_clock:
            self.correction.observe(predicted[0], predicted[1], observed_s)

    def _seconds(self, shape: StepShape, high: bool) -> float:
        """Corrected prediction: `high` for one step held to the ITL target, else the expected time."""
        total, decode = self.predict_raw(shape)
        return self.correction.seconds(total, decode, high)

    # The decision ------------------------------------------------------------------------------
    def decide(
        self, now: float, running: list[Request], waiting: Iterable[Request], threshold: int, free_slots: int,
    ) -> tuple[int, dict[str, Any] | None]:
        """This step's token budget, and why (None when it is the ceiling: the controller did not act)."""
        rows = self._rows(now, running, waiting, threshold, free_slots)
        num_decodes = sum(1 for r in rows if r.decoding)
        budget, why, missed_anyway = self.ceiling, "", False
        if num_decodes:  # without decodes no inter-token gap is at stake: the ceiling
            floor = min(max(1, sum(r.need for r in rows if r.decoding)), self.ceiling)
            budget, why = self._largest(floor, lambda b: self._step_s(rows, b) <= self.target_itl_s), "itl"
            # Decodes alone over the target: their gaps miss it whatever the budget. The ITL budget then
            # leaves prompts nothing, so without this they would wait for the decodes to finish.
            missed_anyway = self._step_s(rows, floor) > self.target_itl_s
            if budget < self.ceiling and self.target_ttft_s > 0 and (missed_anyway or self._may_miss_itl(num_decodes)):
                b_ttft = self._ttft_budget(rows, budget, later=self.ceiling if missed_anyway else budget)
                if b_ttft > budget:
                    budget, why = b_ttft, "ttft"
        seconds = self._step_s(rows, budget) if rows else 0.0
        self.predicted_now += self._walk(rows, budget)[0] if rows else 0.0
        self.num_gaps += num_decodes
        if seconds > self.target_itl_s and not missed_anyway:  # the allowance counts the misses it chose
            self.num_gaps_over += num_decodes
        if budget >= self.ceiling:
            return self.ceiling, None
        why_ = {"budget": budget, "why": why, "predicted_ms": round(seconds * 1000, 3)}
        if self.correction.decode.warm or self.correction.prefill.warm:
            why_["correction"] = self.correction.summary()
        return budget, why_

    def _may_miss_itl(self, num_decodes: int) -> bool:
        """Whether `num_decodes` more gaps over the ITL target keep the share within ITL_MISS_SHARE."""
        return self.num_gaps_over + num_decodes <= ITL_MISS_SHARE * (self.num_gaps + num_decodes)

    def _ttft_budget(self, rows: list[_Row], b_itl: int, later: int) -> int:
        """The smallest budget from `b_itl` up for this one step (the steps after it at `later`: `b_itl`,
        as the allowance of gaps over the ITL target may be spent by then, or the ceiling when the decodes
        alone miss the target, as every such step may act again) with which every prompt that could get
        its first token within the TTFT target is predicted to; `b_itl` when none needs more. So a prompt
        gets more than the ITL budget only once it would otherwise miss: near its deadline."""
        prompts = [r for r in rows if r.prompt]
        after = self._walk(rows, later)
        at_ceiling = self._first_tokens(rows, self.ceiling, after)
        salvageable = [i for i, t in enumerate(at_ceiling) if prompts[i].age + t <= self.target_ttft_s]
        if not salvageable:
            return b_itl

        def meets(b: int) -> bool:
            times = self._first_tokens(rows, b, after)
            return all(prompts[i].age + times[i] <= self.target_ttft_s for i in salvageable)

        return self._smallest(b_itl, meets)

    # Prediction --------------------------------------------------------------------------------
    def _rows(
        self, now: float, running: list[Request], waiting: Iterable[Request], threshold: int, free_slots: int,
    ) -> list[_Row]:
        rows = []
        for r in running:
            need = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
            if need > 0:
                rows.append(self._row(now, r, need, threshold))
        for r in waiting:
            if free_slots <= 0:
                break
            free_slots -= 1
            rows.append(self._row(now, r, r.num_tokens - r.num_computed_tokens, threshold))
        return rows

    def _row(self, now: float, r: Request, need: int, threshold: int) -> _Row:
        if 0 < threshold < need:
            need = threshold
        if self.predicted_clock:
            age = self.predicted_now - self.arrival.get(r.request_id, self.predicted_now)
        else:
            age = now - r.arrival_time
        # A resumed request recomputing its outputs is neither: its work is a prefill, its first token is out.
        decoding = r.num_output_tokens > 0 and not r.is_prefill
        prompt = r.num_output_tokens == 0 and r.first_token_time is None
        return _Row(start=r.num_computed_tokens, need=need, end=r.num_tokens_with_spec, decoding=decoding,
                    prompt=prompt, age=age)

    def _step_s(self, rows: list[_Row], budget: int) -> float:
        """Predicted seconds of the step at `budget`, as one step held to the ITL target."""
        return self._seconds(self._shape(rows, budget)[0], high=True)

    def _walk(self, rows: list[_Row], budget: int) -> tuple[float, int]:
        """Expected seconds of the step at `budget`, and the prompt tokens it computes."""
        shape, prompt_tokens = self._shape(rows, budget)
        return self._seconds(shape, high=False), prompt_tokens

    def _shape(self, rows: list[_Row], budget: int) -> tuple[StepShape, int]:
        """The step at `budget`, and the prompt tokens it computes."""
        shape, left, prompt_tokens = StepShape(), budget, 0
        for row in rows:
            if left <= 0:
                break
            n = min(row.need, left)
            shape.add_row(row.start, n, row.start + n >= row.end)
            left -= n
            if row.prompt:
                prompt_tokens += n
        return shape, prompt_tokens

    def _first_tokens(self, rows: list[_Row], budget: int, after: tuple[float, int]) -> list[float]:
        """Predicted seconds from now to each prompt's first token: this step at `budget`, the next ones
        as `after` (seconds, prompt tokens per step); inf when it never gets there."""
        seconds, share = self._walk(rows, budget)
        later_seconds, later_share = after
        out, work = [], 0
        for row in rows:
            if row.prompt:
                work += row.end - row.start  # its whole remaining prompt and those ahead of it
                left = work - share
                if left <= 0:
                    out.append(seconds)
                else:
                    out.append(seconds + math.ceil(left / later_share) * later_seconds if later_share > 0
                               else math.inf)
        return out

    def _largest(self, lo: int, ok: Callable[[int], bool]) -> int:
        """The largest budget in [lo, ceiling] with ok(budget) (prediction grows with the budget); lo if none."""
        if ok(self.ceiling):
            return self.ceiling
        return _first(lo, self.ceiling, lambda b: not ok(b)) - 1 if ok(lo) else lo

    def _smallest(self, lo: int, ok: Callable[[int], bool]) -> int:
        """The smallest budget in [lo, ceiling] with ok(budget); the ceiling if none."""
        if ok(lo):
            return lo
        return _first(lo, self.ceiling, ok) if ok(self.ceiling) else self.ceiling


def _first(lo: int, hi: int, flips: Callable[[int], bool]) -> int:
    """Bisection: a b in (lo, hi] with flips(b) and not flips(b - 1), given not flips(lo) and flips(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if flips(mid):
            hi = mid
        else:
            lo = mid
    return hi
