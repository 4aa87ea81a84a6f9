"""The automatic token budget: what a step costs on this machine bounds it, not a token count.

vLLM's default budget, 2,048 tokens a step, assumes a step of that size is short. On a small CPU it
is not: a 0.5B model prefills ~150-200 tokens/s on two cores, so a 2,048-token chunk takes ~10 s, and
every request decoding in that step waits those 10 s for its next token. When `max_num_batched_tokens`
is not given (SchedulerConfig's None, the default), the scheduler therefore bounds the *prefill work*
a step carries while requests decode by time, at this machine's measured rate:

    budget = ceiling                                       no request is decoding (no gap at stake),
                                                           or no step time has been measured yet
    budget = min(ceiling, decode tokens + max(MIN_CHUNK, 1 + K, target_s / seconds_per_token))

where the decode tokens are the running decodes' own (1 + drafts each), the ceiling is 2,048, K the
speculative tokens, and `seconds_per_token` is learnt from the steps the engine executes (the engine
core reports each one's time: `Scheduler.observe_step_time`). So a decode's gap is its decode step
plus at most ~target_s of prefill; prompts always get a chunk (never starved by many decodes); steps
without decodes (a burst's first prompts, an idle engine) keep the whole ceiling; and where a
2,048-token step takes less than the target (a GPU, a small model) the rule never binds: vLLM's
behaviour, step for step.

The rate: each executed step with at least LEARN_MIN_PREFILL prefill tokens gives a sample (its
seconds, its tokens, decodes included: a decode row costs at least a prefill token on these
runners, so the estimate errs on the side of smaller chunks); the estimate is the ratio of
exponentially weighted sums (weight ALPHA), the first sample taken as it is. Steps with only a few
prompt tokens are overhead and decodes, not a prefill rate, and are left out.

Explicit `--max-num-batched-tokens` (any value, 2048 included), `--target-itl-ms` (the SLO controller,
core/slo_budget.py, which then owns the budget) or `--auto-budget-prefill-ms 0` turn this off.
Deterministic given the reported step times (the simulator reports its modelled ones). Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenloom.core.outputs import SchedulerOutput
from tokenloom.core.policies import StepContext, StepPolicy
from tokenloom.core.request import Request

ALPHA = 0.3  # weight of a new step in the rate: a machine that slows down is followed within a few steps
LEARN_MIN_PREFILL = 32  # prefill tokens a step needs for its time to count as a rate sample
MIN_CHUNK = 16  # prompt tokens a step that carries decodes always offers, however slow the machine


@dataclass
class AutoTokenBudget(StepPolicy):
    ceiling: int  # SchedulerConfig.token_budget_ceiling (2048)
    target_s: float  # seconds of prefill work a step that carries decodes may take
    num_spec_tokens: int = 0  # K: a padded first decode (1 + K tokens) must still fit the chunk
    # Exponentially weighted sums of the sampled steps' seconds and tokens (None: nothing measured yet).
    seconds: float | None = None
    tokens: float = 0.0
    num_samples: int = 0

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.seconds is not None and self.tokens > 0 else None

    def observe(self, prefill_tokens: int, total_tokens: int, seconds: float) -> None:
        """An executed step: its prompt tokens, all its tokens, and how long it took."""
        if prefill_tokens < LEARN_MIN_PREFILL or total_tokens <= 0 or not seconds > 0:
            return
        self.num_samples += 1
        if self.seconds is None:
            self.seconds, self.tokens = seconds, float(total_tokens)
            return
        self.seconds += ALPHA * (seconds - self.seconds)
        self.tokens += ALPHA * (total_tokens - self.tokens)

    def chunk(self) -> int | None:
        """Prompt tokens a step that carries decodes may take (None: no rate measured yet)."""
        spt = self.seconds_per_token
        if spt is None:
            return None
        return max(MIN_CHUNK, 1 + self.num_spec_tokens, int(self.target_s / spt))

    # The policy's hooks (core/policies.py StepPolicy) -------------------------------------------
    def budget(self, ctx: StepContext, budget: int) -> int:
        decided, why = self.decide(ctx.running, ctx.admissible_waiting(), ctx.free_slots())
        if why is not None:
            ctx.actions["auto_budget"] = why
        return min(budget, decided)

    def step_done(self, output: SchedulerOutput, seconds: float) -> None:
        self.observe(sum(output.num_prefill_tokens.values()), output.total_num_scheduled_tokens, seconds)

    # The decision ------------------------------------------------------------------------------
    def decide(self, running: list[Request], waiting: Iterable[Request], free_slots: int,
               ) -> tuple[int, dict[str, Any] | None]:  # fmt: skip
        """This step's budget, and why (None when it is the ceiling or cannot bind: nothing acted)."""
        chunk = self.chunk()
        if chunk is None or chunk >= self.ceiling:
            return self.ceiling, None
        decode_tokens = prompt_tokens = 0
        for r in running:
            need = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
            if need <= 0:
                continue
            if r.num_output_tokens > 0 and not r.is_prefill:
                decode_tokens += need
            else:
                prompt_tokens += need
        if decode_tokens == 0:  # no inter-token gap at stake: the ceiling gives the earliest first tokens
            return self.ceiling, None
        for r in waiting:
            if free_slots <= 0 or prompt_tokens > chunk:
                break
            free_slots -= 1
            prompt_tokens += max(r.num_tokens - r.num_computed_tokens, 1 + self.num_spec_tokens)
        budget = min(self.ceiling, decode_tokens + chunk)
        if decode_tokens + prompt_tokens <= budget:  # everything fits: the budget would not bind
            return self.ceiling, None
        spt = self.seconds_per_token
        assert spt is not None
        return budget, {"budget": budget, "chunk": chunk, "ms_per_token": round(spt * 1000, 4)}
