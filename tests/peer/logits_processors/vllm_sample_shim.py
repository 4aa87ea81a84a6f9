"""vLLM's names, as its tests/v1/logits_processors/test_correctness.py imports them, mapped onto tokenloom
(plumbing only): the built-in logits processors and the thinking-budget state applied to a persistent batch.

vLLM's built-ins (min_tokens, logit_bias, min_p) are processor classes that keep per-row state across the batch's
BatchUpdates, and its thinking budget a per-row state holder. tokenloom's are the sampler's per-row steps over a
SamplingRow (tokenloom/model/sampler.py: `apply_min_tokens`, `apply_logit_bias`, `apply_min_p_to_logits`,
`apply_forced_tokens`; speculative positions: tokenloom/model/rejection_sampler.py `position_rows`) and a
per-request tracker (tokenloom/model/thinking_budget.py, built by the runner's `_thinking_budget`). The shapes
match row for row, so the classes here only hold each row's request as tokenloom's runner does and hand the rows to
those functions:

- each row's state follows the BatchUpdates through tokenloom's `process_dict_updates` (its persistent-batch rule,
  the one custom processors use);
- a row is a SamplingRow of the request's params over its prompt and its live output list (tokenloom's
  ExtendedTokens view, so outputs appended later are seen, as vLLM's processors see them); a row without the
  processor's parameter is a plain one;
- `MinTokensLogitsProcessor.min_toks` is the rows still under their min_tokens, in vLLM's tuple layout, which the
  test reads; `apply_with_spec_decode(logits, rows_per_request)` gives each request one row per draft position
  plus the bonus (`position_rows`; the test names no draft tokens, whose values min_tokens does not read);
- `ThinkingBudgetStateHolder`: one tracker per row with a budget (the runner's rule; the request's start / end
  token ids come from the reasoning config, as the engine's input processor fills them in); `_state` shows each
  tracker under vLLM's keys (`in_think`, `think_count`, `in_end`: the end string is being forced, `end_count`: its
  next token) and `apply_to_logits` is tokenloom's forcing (the token's logit to 1e9, after the penalties);
- vLLM's config and metadata objects are holders of the fields the test sets; `build_logitsprocs` builds the three
  built-ins into tokenloom's LogitsProcessors container.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.model.rejection_sampler import ExtendedTokens, VerifyRequest, position_rows
from tokenloom.model.runner import _thinking_budget
from tokenloom.model.sampler import (
    SamplingRow,
    apply_forced_tokens,
    apply_logit_bias,
    apply_min_p_to_logits,
    apply_min_tokens,
)
from tokenloom.model.thinking_budget import ThinkingBudget
from tokenloom.sample.logits_processor import (  # noqa: F401  (vLLM's names)
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    process_dict_updates,
)
from tokenloom.sampling_params import (  # noqa: F401
    SamplingParams,
    StructuredOutputsParams,
    validate_thinking_token_budget,
)

_PLAIN_PARAMS = SamplingParams()


def _row(params: Any, prompt_tok_ids: list[int] | None, output_tok_ids: list[int]) -> SamplingRow:
    prompt = list(prompt_tok_ids or ())
    return SamplingRow(params, ExtendedTokens(prompt, output_tok_ids), len(prompt))


def _plain_row() -> SamplingRow:
    return SamplingRow(_PLAIN_PARAMS, [], 0)


# Configs and metadata ------------------------------------------------------------------------------------------
class ReasoningConfig:
    """vLLM's ReasoningConfig, as far as the test's MagicMock(spec=...) reads it."""

    reasoning_start_token_ids: list[int]
    reasoning_end_token_ids: list[int]


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128


@dataclass
class VllmConfig:
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: Any = None
    reasoning_config: Any = None


@dataclass
class SamplingMetadata:
    """vLLM's SamplingMetadata: the fields the test fills in; tokenloom's sampler reads each row's own params."""

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: Any
    top_k: Any
    generators: dict
    max_num_logprobs: int
    prompt_token_ids: torch.Tensor
    output_token_ids: list[list[int]]
    frequency_penalties: torch.Tensor
    presence_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    no_penalties: bool
    allowed_token_ids_mask: Any
    bad_words_token_ids: dict
    logitsprocs: LogitsProcessors
    thinking_budget_state_holder: Any = None
    spec_token_ids: Any = None


def make_tensor_with_pad(rows: list[list[int]], pad: int, device: Any, dtype: torch.dtype,
                         pin_memory: bool = False) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=dtype, device=device)


class _Platform:
    device_type = "cpu"

    @staticmethod
    def device_count() -> int:
        return 1


current_platform = _Platform()


def is_pin_memory_available() -> bool:
    return False


def create_new_process_for_each_test() -> Callable[[Callable], Callable]:
    """vLLM runs these cases in a fresh process (its processors' pinned memory starts a CUDA context); tokenloom's
    take no pinned memory, so they run in the test's process."""
    return lambda fn: fn


# The built-ins ----------------------------------------------------------------------------------------------------
class _RowsProcessor(LogitsProcessor):
    """Keeps the rows whose request uses this built-in, applies tokenloom's sampler step to the batch."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, SamplingRow] = {}

    def _new_row(self, params: Any, prompt: list[int] | None, output: list[int]) -> SamplingRow | None:
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def batch_rows(self, num_rows: int) -> list[SamplingRow]:
        return [self.rows.get(i) or _plain_row() for i in range(num_rows)]


class LogitBiasLogitsProcessor(_RowsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def _new_row(self, params: Any, prompt: list[int] | None, output: list[int]) -> SamplingRow | None:
        return _row(params, prompt, output) if params.logit_bias else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        apply_logit_bias(logits, self.batch_rows(logits.shape[0]))
        return logits


class MinPLogitsProcessor(_RowsProcessor):
    def is_argmax_invariant(self) -> bool:
        return True

    def _new_row(self, params: Any, prompt: list[int] | None, output: list[int]) -> SamplingRow | None:
        return _row(params, prompt, output) if params.min_p > 0.0 else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        apply_min_p_to_logits(logits, self.batch_rows(logits.shape[0]))
        return logits


class MinTokensLogitsProcessor(_RowsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def _new_row(self, params: Any, prompt: list[int] | None, output: list[int]) -> SamplingRow | None:
        return _row(params, prompt, output) if params.min_tokens else None

    @property
    def min_toks(self) -> dict[int, tuple[int, Sequence[int], set[int], None]]:
        return {i: (r.params.min_tokens, r.output_token_ids, r.params.all_stop_token_ids, None)
                for i, r in self.rows.items() if r.num_output_tokens < r.params.min_tokens}

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        apply_min_tokens(logits, self.batch_rows(logits.shape[0]))
        return logits

    def apply_with_spec_decode(self, logits: torch.Tensor, rows_per_request: list[int]) -> torch.Tensor:
        requests = [VerifyRequest(row, [-1] * (n - 1)) for row, n in zip(self.batch_rows(len(rows_per_request)),
                                                                       rows_per_request)]
        apply_min_tokens(logits, position_rows(requests))
        return logits


def build_logitsprocs(vllm_config: Any, device: torch.device, is_pin_memory: bool,
                      is_pooling_model: bool) -> LogitsProcessors:
    return LogitsProcessors(cls(vllm_config, device, is_pin_memory)
                            for cls in (MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor))


# The thinking budget ----------------------------------------------------------------------------------------------
@dataclass
class _TrackedRow:
    budget: ThinkingBudget
    prompt: list[int]
    forced_token: int | None = None


class ThinkingBudgetStateHolder:
    def __init__(self, reasoning_config: Any, max_num_seqs: int, num_spec_tokens: int, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.think_start_token_ids = list(reasoning_config.reasoning_start_token_ids)
        self.think_end_token_ids = list(reasoning_config.reasoning_end_token_ids)
        self._rows: dict[int, _TrackedRow] = {}

    def _new_row(self, params: Any, prompt: list[int] | None, output: list[int]) -> _TrackedRow | None:
        params._thinking_token_ids = (tuple(self.think_start_token_ids), tuple(self.think_end_token_ids))
        prompt = list(prompt or ())
        tracker = _thinking_budget(params, prompt, len(prompt))
        return _TrackedRow(tracker, prompt) if tracker is not None else None

    def sync_batch(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)

    def has_tracked_requests(self) -> bool:
        return bool(self._rows)

    def update_state(self, output_token_ids: list[list[int]], spec_token_ids: Any,
                     repeat_indices: Any = None) -> None:
        for index, row in self._rows.items():
            if index < len(output_token_ids):
                row.forced_token = row.budget.forced_token(ExtendedTokens(row.prompt, output_token_ids[index]))

    def apply_to_logits(self, logits: torch.Tensor, is_greedy: bool, spec_token_ids: Any) -> torch.Tensor:
        rows = [_plain_row() for _ in range(logits.shape[0])]
        for index, row in self._rows.items():
            if index < len(rows):
                rows[index].forced_token = row.forced_token
        apply_forced_tokens(logits, rows)
        return logits

    @property
    def _state(self) -> dict[int, dict[str, Any]]:
        return {index: {"thinking_token_budget": row.budget.budget, "in_think": row.budget.in_think,
                        "think_count": row.budget.count, "in_end": row.budget.forcing is not None,
                        "end_count": row.budget.forcing or 0}
                for index, row in self._rows.items()}


def maybe_create_thinking_budget_state_holder(reasoning_config: Any, max_num_seqs: int, num_spec_tokens: int,
                                              device: torch.device, is_pin_memory: bool
                                              ) -> ThinkingBudgetStateHolder | None:
    if reasoning_config is None:
        return None
    return ThinkingBudgetStateHolder(reasoning_config, max_num_seqs, num_spec_tokens, device, is_pin_memory)
