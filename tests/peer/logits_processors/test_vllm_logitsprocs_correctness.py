# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/logits_processors/test_correctness.py, the test bodies unchanged: vLLM's
# built-in logits processors (min_tokens, logit_bias, min_p) and its thinking-budget state, applied to a persistent
# batch that requests join, leave, move and swap in, run on tokenloom's sampler steps and thinking-budget tracker
# through tests/peer/logits_processors/vllm_sample_shim.py (its docstring says how the shapes map). Plumbing: the
# imports (vLLM's tests/v1/sample/utils.py helpers vendored as vllm_sample_utils.py). test_logitsprocs (6 batches of
# 50 requests per processor, a few seconds each) runs in `make test-peer` only (TOKENLOOM_PEER_FULL=1). Left out,
# vLLM-only machinery: the thinking-budget holder's own layout (test_maybe_create_..._without_reasoning,
# ..._update_state_repeat_indices_last_row_wins, ..._spec_mode_tensor_layout,
# ..._long_thinking_section_end_marker_found_at_correct_index and test_continue_thinking_natural_end_reentry read
# its internal fields: spec-decode repeat indices, tensor capacity, scan offsets, the continue_thinking flag), and
# ..._empty_end_tokens_disables_row (tokenloom refuses a thinking_token_budget when the reasoning parser's end
# string has no tokens, so no tracker is ever made without them).

import random
from collections.abc import Callable
from typing import NamedTuple, NoReturn, TypeAlias

import numpy as np
import pytest
import torch

from tests.peer.logits_processors.vllm_sample_shim import (
    BatchUpdate,
    BatchUpdateBuilder,
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
    SamplingMetadata,
    SamplingParams,
    StructuredOutputsParams,
    ThinkingBudgetStateHolder,
    VllmConfig,
    build_logitsprocs,
    create_new_process_for_each_test,
    current_platform,
    is_pin_memory_available,
    maybe_create_thinking_budget_state_holder,
    validate_thinking_token_budget,
)
from tests.peer.logits_processors.vllm_sample_utils import (
    LogitsprocsTestFakes,
    create_fake_logits,
    create_mock_reasoning_config,
    create_penalty_tensor,
    create_prompt_tokens_tensor,
    fake_apply_logitsprocs,
    fake_update_logitsprocs_state,
)

PIN_MEMORY_AVAILABLE = is_pin_memory_available()
MAX_NUM_REQS = 256
VOCAB_SIZE = 1024
NUM_OUTPUT_TOKENS = 20
DEVICE_TYPE = current_platform.device_type
DEVICES = [
    f"{DEVICE_TYPE}:{i}"
    for i in range(1 if current_platform.device_count() == 1 else 2)
]
MAX_NUM_PROMPT_TOKENS = 64
MIN_TOKENS_LEN_THRESHOLD = 5
REQS_PER_LOGITPROC = 50
STR_NO_LOGITPROC = "none"
# Thinking budget uses ``ThinkingBudgetStateHolder`` (not a logits processor).
STR_THINKING_BUDGET = "thinking_budget"

# Thinking token budget testing constants
THINKING_TOKEN_BUDGET = 5
THINK_START_TOKEN_ID = 999
THINK_END_TOKEN_ID = 998

# LogitsProcessor subclass or "none"
LogitprocType: TypeAlias = type[LogitsProcessor] | str


class LogitsProcsRequestParams:
    """Encapsulates key params for a single request in a batch.

    Params can be customized based on the enabled logitproc
    """

    workload_index: int
    logitproc_type: LogitprocType  # Logitproc enabled, specified by str id
    out_tokens: list[int]  # Output tokens required for min tokens test
    prompt_tokens: list[int]  # Dummy prompt tokens placeholder
    params: SamplingParams  # Settings customized for logitproc

    def __init__(self, workload_index: int, logitproc_type: LogitprocType):
        self.workload_index = workload_index
        self.logitproc_type = logitproc_type
        # Number of output tokens is randomly 0 or twice the min-tokens
        # threshold which will be used in testing.
        # Generate diverse random tokens for all processors (more realistic)
        num_tokens = MIN_TOKENS_LEN_THRESHOLD * random.randint(0, 2)
        if num_tokens > 0:
            # Use diverse random tokens
            self.out_tokens = [random.randint(1, 950) for _ in range(num_tokens)]
            # Think-start seed for ``STR_THINKING_BUDGET`` rows.
            if logitproc_type == STR_THINKING_BUDGET:
                self.out_tokens[0] = THINK_START_TOKEN_ID
        else:
            self.out_tokens = []
        self.prompt_tokens = []
        self.params = _sampling_params_from_logitproc(logitproc_type)

    def __str__(self):
        """For debugging."""
        summ = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"MyClass({summ})"


def _generate_fake_sampling_metadata(
    num_output_tokens: int,
    batch_size: int,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Generate fake sampling metadata with fake logitsprocs."""
    output_token_ids: list[list[int]] = []
    prompt_token_ids: list[list[int]] = []
    for _ in range(batch_size):
        output_token_ids.append(
            np.random.randint(0, vocab_size, size=num_output_tokens).tolist()
        )
        prompt_token_ids.append(
            np.random.randint(
                0, vocab_size, size=np.random.randint(1, MAX_NUM_PROMPT_TOKENS)
            ).tolist()
        )

    vllm_config = VllmConfig()
    vllm_config.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )

    logitsprocs = build_logitsprocs(
        vllm_config=vllm_config,
        device=device,
        is_pin_memory=PIN_MEMORY_AVAILABLE,
        is_pooling_model=False,
    )
    num_spec = (
        vllm_config.speculative_config.num_speculative_tokens
        if vllm_config.speculative_config
        else 0
    )
    thinking_holder = maybe_create_thinking_budget_state_holder(
        vllm_config.reasoning_config,
        vllm_config.scheduler_config.max_num_seqs,
        num_spec,
        device,
        is_pin_memory=False,
    )
    fake_sampling_metadata = SamplingMetadata(
        temperature=torch.full((batch_size,), 0.0),
        all_greedy=True,
        all_random=False,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=0,
        prompt_token_ids=create_prompt_tokens_tensor(
            prompt_token_ids, vocab_size, device
        ),
        output_token_ids=output_token_ids,
        frequency_penalties=create_penalty_tensor(batch_size, 0.0, device),
        presence_penalties=create_penalty_tensor(batch_size, 0.0, device),
        repetition_penalties=create_penalty_tensor(batch_size, 1.0, device),
        no_penalties=True,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=logitsprocs,
        thinking_budget_state_holder=thinking_holder,
    )
    return fake_sampling_metadata


def _generate_test_fakes(batch_size: int, device: str) -> LogitsprocsTestFakes:
    """Generate fake logits and sampling metadata."""
    fake_logits = create_fake_logits(batch_size, VOCAB_SIZE)
    # Create one dominant token per batch, to support min-p test
    for i in range(batch_size):
        fake_logits[i, 0] = 10.0  # High logit for first token
        fake_logits[i, 1:] = 1e-2  # Others remain low
    sampling_metadata = _generate_fake_sampling_metadata(
        NUM_OUTPUT_TOKENS, batch_size, VOCAB_SIZE, torch.device(device)
    )
    return LogitsprocsTestFakes(
        logits=fake_logits,
        sampling_metadata=sampling_metadata,
    )


def _sampling_params_from_logitproc(logitproc_type: LogitprocType) -> SamplingParams:
    """Customize request SamplingParams for a specified logitproc."""
    # SamplingParams for req with no logitproc
    kwargs = {"min_p": 0.0, "logit_bias": None, "min_tokens": 0}
    if fxn := logitsprocs_test_mapping[logitproc_type].gen_request_fxn:
        fxn(kwargs)
    return SamplingParams(**kwargs)


def _generate_mixed_logitsprocs_batch_params(
    reqs_per_logitproc: int,
    logitsprocs_types: list[LogitprocType],
) -> list[LogitsProcsRequestParams]:
    """Define key params for a batch of requests with a different
    logitproc enabled per request.

    The batch will have `reqs_per_logitproc` repeats for all
    `logitsprocs_types` under test, including the case where
    no logitsproc is enabled. The batch is randomly shuffled. The
    size of the batch is `reqs_per_logitproc` times
    `n = len(logitsprocs_types)`

    Args:
      reqs_per_logitproc: number of requests using each logitproc
      logitsprocs_types: logitsprocs under test

    Returns:
      List of per-request params which configure the engine for that request's
      enabled logitproc

    """
    batch_size = len(logitsprocs_types) * reqs_per_logitproc
    # Generate multiple repeats of key params for each logitproc;
    # apply random inverse permutation to the iteration
    # over logitsprocs, such that logitsprocs are shuffled.
    batch_perm = random.sample(range(batch_size), k=batch_size)
    return [
        LogitsProcsRequestParams(
            workload_index=idx,
            logitproc_type=logitsprocs_types[pdx // reqs_per_logitproc],
        )
        for idx, pdx in enumerate(batch_perm)
    ]


def _raise_error_invalid(
    msg_suffix: str,
    batch_index: int,
    request_params: LogitsProcsRequestParams,
    step_idx: int,
    err_cls: type[Exception] = ValueError,
) -> NoReturn:
    raise err_cls(
        f"Validation failed for step={step_idx}, "
        f"batch_index={batch_index}, "
        f"workload_index={request_params.workload_index}, "
        f"req_params={request_params}. Reason: {msg_suffix}"
    )


def _logit_bias_params(kwargs: dict) -> None:
    """Logit bias config."""
    kwargs["logit_bias"] = {
        random.randint(0, VOCAB_SIZE - 1): random.choice([-0.1, 0.2])
    }


def _logit_bias_validate(
    test_fakes: LogitsprocsTestFakes,
    persistent_batch: list[LogitsProcsRequestParams],
    logits_new: torch.Tensor,
    batch_index: int,
    request_params: LogitsProcsRequestParams,
    step_idx: int,
) -> None:
    """Validate logit bias logitproc applied correctly."""
    logit_bias = request_params.params.logit_bias
    assert logit_bias is not None
    logits_old = test_fakes.logits[persistent_batch[batch_index].workload_index].cpu()
    logits_new = logits_new[batch_index].cpu()
    for token_id in range(VOCAB_SIZE):
        logit_old_value = logits_old[token_id]
        logit_new_value = logits_new[token_id]
        if token_id in logit_bias:
            bias_value = logit_bias[token_id]
            exp_value = bias_value + logit_old_value
            if logit_new_value != pytest.approx(exp_value):
                _raise_error_invalid(
                    msg_suffix=(
                        f"Biased token {token_id} logit value {logit_new_value} "
                        f"does not match expected value {exp_value} "
                        f"given bias {bias_value}"
                    ),
                    batch_index=batch_index,
                    request_params=request_params,
                    step_idx=step_idx,
                )

        else:
            if logit_new_value != pytest.approx(logit_old_value):
                _raise_error_invalid(
                    msg_suffix=(
                        f"Unbiased token {token_id} logit value {logit_new_value} "
                        f"does not match expected value {logit_old_value}"
                    ),
                    batch_index=batch_index,
                    request_params=request_params,
                    step_idx=step_idx,
                )


def _min_p_params(kwargs: dict) -> None:
    """Min-p logitproc config."""
    kwargs["min_p"] = 0.1


def _min_p_validate(
    test_fakes: LogitsprocsTestFakes,
    persistent_batch: list[LogitsProcsRequestParams],
    logits_new: torch.Tensor,
    batch_index: int,
    request_params: LogitsProcsRequestParams,
    step_idx: int,
) -> None:
    """Validate min-p logitproc applied correctly."""
    for token_id in range(VOCAB_SIZE):
        logits_for_token = logits_new[batch_index][token_id]
        if token_id == 0:
            # Dominant token should always be unmasked
            if logits_for_token == -float("inf"):
                _raise_error_invalid(
                    msg_suffix="Invalid: dominant token 0 masked (-inf)",
                    batch_index=batch_index,
                    request_params=request_params,
                    step_idx=step_idx,
                )
        else:
            if request_params.params.min_p > 0.0:
                # Non-dominant tokens should be masked when min_p > 0
                if logits_for_token != -float("inf"):
                    _raise_error_invalid(
                        msg_suffix=f"Invalid: non-dominant token {token_id} not masked",
                        batch_index=batch_index,
                        request_params=request_params,
                        step_idx=step_idx,
                    )
            else:
                # No masking when min_p is 0
                if logits_for_token == -float("inf"):
                    _raise_error_invalid(
                        msg_suffix=f"Invalid: token {token_id} masked when min_p=0.0",
                        batch_index=batch_index,
                        request_params=request_params,
                        step_idx=step_idx,
                    )


def _min_tokens_params(kwargs: dict) -> None:
    """Min-tokens logitproc config."""
    kwargs["min_tokens"] = MIN_TOKENS_LEN_THRESHOLD
    kwargs["stop_token_ids"] = [
        np.random.randint(0, VOCAB_SIZE - 1)
        for _ in range(np.random.randint(0, VOCAB_SIZE))
    ]


def _min_tokens_validate(
    test_fakes: LogitsprocsTestFakes,
    persistent_batch: list[LogitsProcsRequestParams],
    logits_new: torch.Tensor,
    batch_index: int,
    request_params: LogitsProcsRequestParams,
    step_idx: int,
) -> None:
    """Validate min-tokens logitsproc applied correctly."""
    ref_num_out_tokens = len(request_params.out_tokens)
    min_reached = ref_num_out_tokens >= MIN_TOKENS_LEN_THRESHOLD
    ref_all_stop_token_ids = request_params.params.all_stop_token_ids
    mt_lp = next(test_fakes.get_logitsprocs_by_cls(MinTokensLogitsProcessor))
    assert isinstance(mt_lp, MinTokensLogitsProcessor)
    min_tok = mt_lp.min_toks.get(batch_index, None)

    # Validate min-token logits processor state
    if min_tok:
        (_, out_tok, all_stop_token_ids, _) = min_tok
        num_out_tokens = len(out_tok)
        if num_out_tokens != ref_num_out_tokens:
            _raise_error_invalid(
                msg_suffix=(
                    "Number of output tokens in min-token logit processor "
                    f"request metadata ({num_out_tokens}) does not match "
                    f"reference ({ref_num_out_tokens})."
                ),
                batch_index=batch_index,
                request_params=request_params,
                step_idx=step_idx,
            )
        if ref_all_stop_token_ids != all_stop_token_ids:
            _raise_error_invalid(
                msg_suffix=(
                    "Stop token ids do not match reference; all_stop_token_ids: "
                    f"{sorted(all_stop_token_ids)}, ref_all_stop_token_ids: "
                    f"{sorted(ref_all_stop_token_ids)}"
                ),
                batch_index=batch_index,
                request_params=request_params,
                step_idx=step_idx,
            )
        if min_reached:
            _raise_error_invalid(
                msg_suffix=(
                    "Expected min-tokens request with min reached, but batch "
                    "index is recognized by min-tokens logits processor."
                ),
                batch_index=batch_index,
                request_params=request_params,
                step_idx=step_idx,
                err_cls=RuntimeError,
            )

    elif not min_reached:
        _raise_error_invalid(
            msg_suffix=(
                "Expected min-tokens request with min not reached, but batch "
                "index is not recognized by min-tokens logits processor."
            ),
            batch_index=batch_index,
            request_params=request_params,
            step_idx=step_idx,
            err_cls=RuntimeError,
        )

    # Validate min-token logits
    for token_id in range(VOCAB_SIZE):
        logits_for_token = logits_new[batch_index][token_id]
        if token_id in ref_all_stop_token_ids and not min_reached:
            if logits_for_token != -float("inf"):
                _raise_error_invalid(
                    msg_suffix=(
                        f"Token {token_id} is a stop token and "
                        "the sequence has not reached min length, "
                        "but the token is not masked "
                        f"(logit={logits_for_token})"
                    ),
                    batch_index=batch_index,
                    request_params=request_params,
                    step_idx=step_idx,
                )
        else:
            if logits_for_token == -float("inf"):
                _raise_error_invalid(
                    msg_suffix=(
                        f"Token {token_id} should not be masked but "
                        f"is (output len={ref_num_out_tokens})"
                    ),
                    batch_index=batch_index,
                    request_params=request_params,
                    step_idx=step_idx,
                )


def _make_min_tokens_processor() -> MinTokensLogitsProcessor:
    return MinTokensLogitsProcessor(VllmConfig(), torch.device("cpu"), False)


# Constructing the processor allocates pinned host memory, which creates a
# CUDA driver context even though the tensors stay on CPU. Run these in their
# own process so the pytest process can still fork for `test_logitsprocs`.
@create_new_process_for_each_test()
def test_min_tokens_keeps_all_masked_behavior_without_structured_output():
    processor = _make_min_tokens_processor()
    processor.update_state(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(min_tokens=2, stop_token_ids=[0]),
                    None,
                    [],
                )
            ],
            moved=(),
        )
    )

    logits = torch.full((1, 3), -float("inf"))
    logits[0, 0] = 1.0

    processor.apply(logits)

    assert torch.isneginf(logits).all()


@create_new_process_for_each_test()
def test_min_tokens_restores_all_masked_structured_output_stop_token():
    processor = _make_min_tokens_processor()
    processor.update_state(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(
                        min_tokens=2,
                        stop_token_ids=[0],
                        structured_outputs=StructuredOutputsParams(
                            json={"type": "boolean"}
                        ),
                    ),
                    None,
                    [],
                )
            ],
            moved=(),
        )
    )

    logits = torch.full((1, 3), -float("inf"))
    logits[0, 0] = 1.0

    processor.apply(logits)

    assert logits[0, 0] == 1.0
    assert torch.isneginf(logits[0, 1:]).all()


@create_new_process_for_each_test()
def test_min_tokens_restores_all_masked_structured_output_stop_token_spec_decode():
    processor = _make_min_tokens_processor()
    processor.update_state(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(
                        min_tokens=2,
                        stop_token_ids=[0, 1],
                        structured_outputs=StructuredOutputsParams(
                            json={"type": "boolean"}
                        ),
                    ),
                    None,
                    [],
                )
            ],
            moved=(),
        )
    )

    logits = torch.full((2, 4), -float("inf"))
    logits[0, 0] = 1.0
    logits[0, 1] = 2.0
    logits[1, 0] = 3.0

    processor.apply_with_spec_decode(logits, [2])

    assert logits[0, 0] == 1.0
    assert logits[0, 1] == 2.0
    assert logits[1, 0] == 3.0
    assert torch.isneginf(logits[1, 1:]).all()
    assert torch.isneginf(logits[:, 2:]).all()


def _thinking_budget_params(kwargs: dict) -> None:
    """Set SamplingParams kwargs for thinking token budget tests."""
    kwargs["thinking_token_budget"] = THINKING_TOKEN_BUDGET


def _thinking_budget_validate(
    test_fakes: LogitsprocsTestFakes,
    persistent_batch: list[LogitsProcsRequestParams],
    logits_new: torch.Tensor,
    batch_index: int,
    request_params: LogitsProcsRequestParams,
    step_idx: int,
) -> None:
    """Validate ``ThinkingBudgetStateHolder`` thinking-budget behavior.

    State is keyed by **batch slot** (same index space as logits rows), matching
    ``sync_batch`` / sampler integration (see PR #34668 discussion).
    """
    holder = test_fakes.sampling_metadata.thinking_budget_state_holder
    assert holder is not None
    state = holder._state.get(batch_index)
    params = request_params.params

    if hasattr(params, "thinking_token_budget") and params.thinking_token_budget:
        if state is None:
            _raise_error_invalid(
                msg_suffix=(
                    f"Expected holder state for batch slot {batch_index} "
                    f"with thinking_token_budget={params.thinking_token_budget}"
                ),
                batch_index=batch_index,
                request_params=request_params,
                step_idx=step_idx,
            )

        expected_budget = params.thinking_token_budget
        actual_budget = state["thinking_token_budget"]
        if actual_budget != expected_budget:
            _raise_error_invalid(
                msg_suffix=(
                    f"Budget mismatch: expected {expected_budget}, got {actual_budget}"
                ),
                batch_index=batch_index,
                request_params=request_params,
                step_idx=step_idx,
            )

        output_tokens = request_params.out_tokens
        start_tokens = holder.think_start_token_ids
        thinking_started = False
        if len(start_tokens) > 0:
            for i in range(len(output_tokens) - len(start_tokens) + 1):
                if output_tokens[i : i + len(start_tokens)] == start_tokens:
                    thinking_started = True
                    break

        if thinking_started:
            think_count = state["think_count"]
            budget = state["thinking_token_budget"]
            if think_count >= budget and not state["in_end"]:
                _raise_error_invalid(
                    msg_suffix=(
                        f"Budget exceeded ({think_count} >= {budget}) but "
                        "in_end is false"
                    ),
                    batch_index=batch_index,
                    request_params=request_params,
                    step_idx=step_idx,
                )

            end_tokens = holder.think_end_token_ids
            if (
                think_count >= budget
                and state["in_end"]
                and len(end_tokens) > 0
                and holder.has_tracked_requests()
            ):
                expected_end_token_id = end_tokens[
                    min(state["end_count"], len(end_tokens) - 1)
                ]
                # Holder bumps forced vocab positions to 1e9 (does not -inf others).
                forced_logit = float(logits_new[batch_index, expected_end_token_id])
                if forced_logit < 1.0e8:
                    _raise_error_invalid(
                        msg_suffix=(
                            f"Expected forced end token {expected_end_token_id} "
                            f"with large logit, got {forced_logit}"
                        ),
                        batch_index=batch_index,
                        request_params=request_params,
                        step_idx=step_idx,
                    )


def _none_validate(
    test_fakes: LogitsprocsTestFakes,
    persistent_batch: list[LogitsProcsRequestParams],
    logits_new: torch.Tensor,
    batch_index: int,
    request_params: LogitsProcsRequestParams,
    step_idx: int,
) -> None:
    """Validate that no logits processors are applied."""
    logits = test_fakes.logits[persistent_batch[batch_index].workload_index].cpu()
    ref_logits = logits_new[batch_index]
    if not torch.all(ref_logits == logits):
        mismatch_toks = (ref_logits != logits).nonzero(as_tuple=True)[0].tolist()
        mismatch_strs = []
        for token in mismatch_toks:
            val = float(logits[token])
            ref_val = float(ref_logits[token])
            mismatch_strs.append(f"({token=},{val=},{ref_val=})")
        _raise_error_invalid(
            msg_suffix=(
                f"Unexpected modification of logits: {','.join(mismatch_strs)}"
            ),
            batch_index=batch_index,
            request_params=request_params,
            step_idx=step_idx,
        )


class LogitsprocTestHelpers(NamedTuple):
    """Supports setting up and validating logitsprocs unit tests."""

    eval_fxn: Callable
    gen_request_fxn: Callable | None = None


logitsprocs_test_mapping: dict[LogitprocType, LogitsprocTestHelpers] = {
    STR_NO_LOGITPROC: LogitsprocTestHelpers(eval_fxn=_none_validate),
    LogitBiasLogitsProcessor: LogitsprocTestHelpers(
        gen_request_fxn=_logit_bias_params, eval_fxn=_logit_bias_validate
    ),
    MinPLogitsProcessor: LogitsprocTestHelpers(
        gen_request_fxn=_min_p_params, eval_fxn=_min_p_validate
    ),
    MinTokensLogitsProcessor: LogitsprocTestHelpers(
        gen_request_fxn=_min_tokens_params, eval_fxn=_min_tokens_validate
    ),
    STR_THINKING_BUDGET: LogitsprocTestHelpers(
        gen_request_fxn=_thinking_budget_params, eval_fxn=_thinking_budget_validate
    ),
}


def _get_test_cases() -> list[list[LogitprocType]]:
    """Each test case is a set of logitsprocs."""
    logitsprocs_types: list[LogitprocType] = list(logitsprocs_test_mapping.keys())

    # Isolate thinking-budget handling from other processors to avoid cross-talk.
    thinking_id: LogitprocType = STR_THINKING_BUDGET
    other_processors: list[LogitprocType] = [
        p for p in logitsprocs_types if p != STR_NO_LOGITPROC and p != thinking_id
    ]

    test_cases: list[list[LogitprocType]] = [[STR_NO_LOGITPROC]]
    test_cases.extend(
        [logitproc_type, STR_NO_LOGITPROC] for logitproc_type in other_processors
    )
    test_cases.extend([other_processors, [thinking_id]])
    return test_cases


def _generate_fake_step_update(
    persistent_batch: list[LogitsProcsRequestParams],
    workload_params: list[LogitsProcsRequestParams],
    wdx: int,
    batch_update_builder: BatchUpdateBuilder,
) -> tuple[BatchUpdate | None, int, int]:
    batch_size = len(persistent_batch)
    workload_size = len(workload_params)
    workload_reqs_remaining = workload_size - wdx
    max_add_remove_per_step = max(1, int(0.2 * workload_size))

    # 50% of steps: add no reqs
    # Other 50%: add a limited number of reqs (less than the number
    # of workload reqs remaining, less than an arbitrary max)
    # If no workload reqs remain: 100% of steps have 0 adds
    num_step_add = (
        random.choice(
            [
                0,
                random.randint(
                    1, min(max_add_remove_per_step, workload_reqs_remaining)
                ),
            ]
        )
        if workload_reqs_remaining
        else 0
    )

    # 50% of steps: remove no requests
    # Other 50%: remove a limited number of reqs (less than the number
    # persistent batch reqs remaining, less than an arbitrary max)
    # If persistent batch is empty: 100% of steps have 0 removals until
    # more requests are added. Assume that removed requests are always
    # drawn from the current batch, before new adds
    num_step_remove = (
        random.choice([0, random.randint(1, min(max_add_remove_per_step, batch_size))])
        if batch_size
        else 0
    )

    num_step_add_replace = min(num_step_add, num_step_remove)

    # Generate fake removed request indices drawn from persistent batch indices
    for removal in random.sample(range(batch_size), num_step_remove):
        batch_update_builder.removed_append(removal)

    # Get added requests from workload
    for add_req_params in workload_params[wdx : (wdx + num_step_add_replace)]:
        # Replace as many removed requests as possible with added requests
        add_remove_idx = batch_update_builder.pop_removed()
        assert add_remove_idx is not None
        batch_update_builder.added.append(
            (
                add_remove_idx,
                add_req_params.params,
                add_req_params.prompt_tokens,
                add_req_params.out_tokens,
            )
        )
        persistent_batch[add_remove_idx] = add_req_params

    # Append remaining added requests to end of batch
    add_reqs_append = workload_params[
        (wdx + num_step_add_replace) : (wdx + num_step_add)
    ]
    batch_update_builder.added.extend(
        [
            (
                adx + batch_size,
                add_req_params.params,
                add_req_params.prompt_tokens,
                add_req_params.out_tokens,
            )
            for adx, add_req_params in enumerate(add_reqs_append)
        ]
    )
    persistent_batch.extend(add_reqs_append)
    pre_condense_batch_size = len(persistent_batch)
    wdx += num_step_add  # Update workload offset

    # Simulate condensing persistent batch
    last_nonempty_index = pre_condense_batch_size - 1
    condensed_to_idxs = set()
    while batch_update_builder.removed:
        if (
            last_nonempty_index in batch_update_builder.removed
            or last_nonempty_index in condensed_to_idxs
        ):
            last_nonempty_index -= 1
            continue
        # last_nonempty_index is the highest persistent batch index that was
        # not removed
        first_empty_index = batch_update_builder.peek_removed()
        assert first_empty_index is not None
        if first_empty_index > last_nonempty_index:
            break
        # first_empty_index is the lowest removed persistent batch index
        # that is less than last_nonempty_index
        #
        # move last_nonempty_index -> first_empty_index
        batch_update_builder.pop_removed()
        condensed_to_idxs.add(first_empty_index)
        persistent_batch[first_empty_index] = persistent_batch[last_nonempty_index]
        batch_update_builder.moved.append(
            (last_nonempty_index, first_empty_index, MoveDirectionality.UNIDIRECTIONAL)
        )

        last_nonempty_index -= 1

    # Now removed requests & gaps left by non-removed requests that got
    # moved downward are grouped consecutively in the upper indices of
    # the persistent batch. Truncate them to get condensed persistent batch
    condensed_batch_size = batch_size + num_step_add - num_step_remove
    persistent_batch[:] = persistent_batch[0:condensed_batch_size]

    if condensed_batch_size > 1:
        # Simulate arbitrary batch ordering in the kernel backend
        # Generate a random number k of non-overlapping swap tuples
        k = random.randint(0, condensed_batch_size // 2)
        idxs = list(range(condensed_batch_size))
        random.shuffle(idxs)
        swaps = [tuple(sorted([idxs[2 * i], idxs[2 * i + 1]])) for i in range(k)]
        batch_update_builder.moved.extend(
            [(sw[0], sw[1], MoveDirectionality.SWAP) for sw in swaps]
        )
        for adx, bdx in swaps:
            persistent_batch[adx], persistent_batch[bdx] = (
                persistent_batch[bdx],
                persistent_batch[adx],
            )

    return (
        batch_update_builder.get_and_reset(condensed_batch_size),
        wdx,
        workload_size - wdx,
    )


def _assert_valid(
    batch_size: int,
    persistent_batch: list[LogitsProcsRequestParams],
    test_fakes: LogitsprocsTestFakes,
    slice_idxs: list[int],
    logits_w_lp: torch.Tensor,
    step_idx: int,
) -> None:
    if not slice_idxs:
        # Trivial case of empty persistent batch
        assert len(persistent_batch) == 0
        if logits_w_lp.shape[0] != 0:
            raise ValueError(
                "Fake persistent batch is empty but logitsprocs "
                f"output batch has shape {logits_w_lp.shape}"
            )
        return

    # Validate logits for each fake request
    for batch_index in range(batch_size):
        request_params = persistent_batch[batch_index]
        # Invoke the appropriate validation function for
        # the logitproc employed by this request
        fxn = logitsprocs_test_mapping[request_params.logitproc_type].eval_fxn
        fxn(
            test_fakes=test_fakes,
            persistent_batch=persistent_batch,
            logits_new=logits_w_lp,
            batch_index=batch_index,
            request_params=request_params,
            step_idx=step_idx,
        )


def _slot_outputs_for_metadata(
    persistent_batch: list[LogitsProcsRequestParams], pad_len: int
) -> list[list[int]]:
    """Per-batch-slot output token ids aligned with ``SamplingMetadata`` rows."""
    rows: list[list[int]] = [[] for _ in range(pad_len)]
    for i, req in enumerate(persistent_batch):
        if i < pad_len:
            rows[i] = list(req.out_tokens)
    return rows


@create_new_process_for_each_test()
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reqs_per_logitproc", [REQS_PER_LOGITPROC])
@pytest.mark.parametrize("logitsprocs_under_test", _get_test_cases())
def test_logitsprocs(
    device: str, reqs_per_logitproc: int, logitsprocs_under_test: list[LogitprocType]
):
    random.seed(40)
    torch.set_default_device(device)

    # Define a shuffled batch of requests which individually use a different
    # logitproc, or no logitproc at all
    workload_params = _generate_mixed_logitsprocs_batch_params(
        reqs_per_logitproc=reqs_per_logitproc, logitsprocs_types=logitsprocs_under_test
    )
    workload_size = len(workload_params)

    # Create fake test data structures for testing.
    test_fakes = _generate_test_fakes(workload_size, device)

    wdx = 0  # Next request index in workload to add
    persistent_batch: list[
        LogitsProcsRequestParams
    ] = []  # Persistent batch state, as list of workload indices

    # Generate fake removed request indices from current persistent
    # batch before adds
    batch_update_builder = BatchUpdateBuilder()

    # Break when entire workload has been added previously and persistent
    # batch is empty
    workload_reqs_remaining = workload_size
    batch_size = 0
    step_idx = 0
    while True:
        if not (workload_reqs_remaining or batch_size):
            break

        (
            batch_update,
            wdx,
            workload_reqs_remaining,
        ) = _generate_fake_step_update(
            persistent_batch=persistent_batch,
            workload_params=workload_params,
            wdx=wdx,
            batch_update_builder=batch_update_builder,
        )
        batch_size = len(persistent_batch)

        # Apply fake batch update to logitsprocs
        fake_update_logitsprocs_state(test_fakes, batch_update)

        # Emulate application of logits processors + thinking holder (sampler order).
        slice_idxs = [req.workload_index for req in persistent_batch]
        slot_rows = _slot_outputs_for_metadata(persistent_batch, workload_size)
        logits_w_lp = fake_apply_logitsprocs(test_fakes, slice_idxs, slot_rows).cpu()

        _assert_valid(
            batch_size=batch_size,
            persistent_batch=persistent_batch,
            test_fakes=test_fakes,
            slice_idxs=slice_idxs,
            logits_w_lp=logits_w_lp,
            step_idx=step_idx,
        )

        step_idx += 1


def test_thinking_budget_holder_has_tracked_after_sync_add():
    vc = VllmConfig()
    vc.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )
    h = ThinkingBudgetStateHolder(
        vc.reasoning_config,
        vc.scheduler_config.max_num_seqs,
        0,
        torch.device("cpu"),
        False,
    )
    assert not h.has_tracked_requests()
    h.sync_batch(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(thinking_token_budget=3),
                    None,
                    [THINK_START_TOKEN_ID],
                )
            ],
            moved=(),
        )
    )
    assert h.has_tracked_requests()
    assert h._state[0]["thinking_token_budget"] == 3


def test_thinking_budget_holder_sync_remove_clears_state():
    vc = VllmConfig()
    vc.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )
    h = ThinkingBudgetStateHolder(
        vc.reasoning_config,
        vc.scheduler_config.max_num_seqs,
        0,
        torch.device("cpu"),
        False,
    )
    h.sync_batch(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(thinking_token_budget=3),
                    None,
                    [],
                )
            ],
            moved=(),
        )
    )
    assert h.has_tracked_requests()
    h.sync_batch(BatchUpdate(batch_size=0, removed=(0,), added=(), moved=()))
    assert not h.has_tracked_requests()


def test_thinking_budget_holder_sync_add_without_budget_drops_row():
    vc = VllmConfig()
    vc.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )
    h = ThinkingBudgetStateHolder(
        vc.reasoning_config,
        vc.scheduler_config.max_num_seqs,
        0,
        torch.device("cpu"),
        False,
    )
    h.sync_batch(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[(0, SamplingParams(), None, [])],
            moved=(),
        )
    )
    assert not h.has_tracked_requests()


def test_thinking_budget_holder_swap_exchanges_state():
    vc = VllmConfig()
    vc.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )
    h = ThinkingBudgetStateHolder(
        vc.reasoning_config,
        vc.scheduler_config.max_num_seqs,
        0,
        torch.device("cpu"),
        False,
    )
    h.sync_batch(
        BatchUpdate(
            batch_size=2,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(thinking_token_budget=3),
                    None,
                    [],
                ),
                (
                    1,
                    SamplingParams(thinking_token_budget=7),
                    None,
                    [],
                ),
            ],
            moved=(),
        )
    )
    b0, b1 = h._state[0]["thinking_token_budget"], h._state[1]["thinking_token_budget"]
    h.sync_batch(
        BatchUpdate(
            batch_size=2,
            removed=(),
            added=(),
            moved=[(0, 1, MoveDirectionality.SWAP)],
        )
    )
    assert h._state[0]["thinking_token_budget"] == b1
    assert h._state[1]["thinking_token_budget"] == b0


def test_thinking_budget_holder_unidirectional_move():
    vc = VllmConfig()
    vc.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )
    h = ThinkingBudgetStateHolder(
        vc.reasoning_config,
        vc.scheduler_config.max_num_seqs,
        0,
        torch.device("cpu"),
        False,
    )
    h.sync_batch(
        BatchUpdate(
            batch_size=2,
            removed=(),
            added=[
                (
                    1,
                    SamplingParams(thinking_token_budget=4),
                    None,
                    [],
                ),
            ],
            moved=(),
        )
    )
    assert 1 in h._state and 0 not in h._state
    h.sync_batch(
        BatchUpdate(
            batch_size=2,
            removed=(),
            added=(),
            moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)],
        )
    )
    assert 0 in h._state and 1 not in h._state
    assert h._state[0]["thinking_token_budget"] == 4


def test_thinking_budget_enforced_without_penalties():
    """Regression test for gpu_input_batch.py bug.

    When thinking_budget_tracks_reqs=True and no penalties/bad_words are set,
    the old code computed needs_output_token_ids=False (inverted condition:
    ``or not thinking_budget_tracks_reqs``), causing update_state to receive
    an empty list and skip _update_think_state for every request.

    Fix: changed ``or not thinking_budget_tracks_reqs`` to
    ``or thinking_budget_tracks_reqs`` so that output_token_ids is populated
    whenever the thinking budget state holder has tracked requests.

    This test verifies that update_state correctly calls _update_think_state
    (setting in_end=True) when given the real output_token_ids, and that
    passing an empty list (the pre-fix behavior) prevents budget enforcement.
    """
    vc = VllmConfig()
    vc.reasoning_config = create_mock_reasoning_config(
        [THINK_START_TOKEN_ID], [THINK_END_TOKEN_ID]
    )
    budget = 3  # allow 3 thinking tokens

    h = ThinkingBudgetStateHolder(
        vc.reasoning_config,
        vc.scheduler_config.max_num_seqs,
        0,
        torch.device("cpu"),
        False,
    )
    output_token_ids: list[int] = []
    h.sync_batch(
        BatchUpdate(
            batch_size=1,
            removed=(),
            added=[
                (
                    0,
                    SamplingParams(thinking_token_budget=budget),
                    None,
                    output_token_ids,
                )
            ],
            moved=(),
        )
    )
    assert h.has_tracked_requests()

    # Simulate the buggy behavior: update_state receives empty list.
    # _update_think_state is skipped → in_end stays False → no budget enforcement.
    h.update_state([], None, None)
    assert not h._state[0].get("in_end", False), (
        "With empty output_token_ids, in_end should stay False (budget not yet tracked)"
    )

    # Simulate the correct behavior: output_token_ids is the live list.
    # Step 1: think-start token appears.
    output_token_ids.append(THINK_START_TOKEN_ID)
    h.update_state([output_token_ids], None, None)
    assert not h._state[0].get("in_end", False), (
        "Still within budget after 0 think tokens"
    )

    # Steps 2–4: 3 thinking tokens (hits the budget exactly).
    for tok in [1, 2, 3]:
        output_token_ids.append(tok)
        h.update_state([output_token_ids], None, None)

    # After exactly `budget` thinking tokens the holder should force end token.
    assert h._state[0].get("in_end", False), (
        "Budget exceeded: in_end should be True so that apply_to_logits "
        "forces the end token"
    )


@pytest.mark.parametrize(
    ("raw_value", "expected"),
    [
        (None, None),
        (-1, None),
        (10, 10),
        (0, 0),
    ],
)
def test_validate_thinking_token_budget(raw_value, expected):
    assert validate_thinking_token_budget(raw_value) == expected


def test_sampling_params_minus_one_normalizes_to_none():
    params = SamplingParams(thinking_token_budget=-1)
    assert params.thinking_token_budget is None


@pytest.mark.parametrize("invalid_budget", [-2, 0.6, 10.5, True])
def test_validate_thinking_token_budget_rejects_invalid(invalid_budget):
    from tokenloom.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
        validate_thinking_token_budget(invalid_budget)


@pytest.mark.parametrize("invalid_budget", [-2, 0.6, 10.5])
def test_thinking_budget_invalid_budget_rejected(invalid_budget):
    from tokenloom.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=invalid_budget)


# --- Thinking budget re-entry tests (issue #43708) ---
# Regression tests: after budget forces end-of-thinking token sequence,
# the state machine must detect and enforce budget on subsequent blocks.


class TestThinkingBudgetReentry:
    THINK_START = 100
    THINK_END_SINGLE = [200]
    THINK_END_MULTI = [200, 201, 202]
    BUDGET = 5
    CONTENT_TOKEN = 50
    THINK_TOKEN = 60

    @staticmethod
    def _make_holder(end_token_ids: list[int]) -> ThinkingBudgetStateHolder:
        cfg = create_mock_reasoning_config(
            [TestThinkingBudgetReentry.THINK_START], end_token_ids
        )
        return ThinkingBudgetStateHolder(
            reasoning_config=cfg,
            max_num_seqs=8,
            num_spec_tokens=0,
            device=torch.device("cpu"),
            is_pin_memory=False,
        )

    @staticmethod
    def _sync_batch(holder: ThinkingBudgetStateHolder, budget: int) -> None:
        holder.sync_batch(
            BatchUpdate(
                batch_size=1,
                removed=(),
                added=[(0, SamplingParams(thinking_token_budget=budget), None, [])],
                moved=(),
            )
        )

    @staticmethod
    def _step(holder: ThinkingBudgetStateHolder, output_tok_ids: list[int]) -> None:
        holder.update_state(
            output_token_ids=[output_tok_ids],
            spec_token_ids=None,
            repeat_indices=None,
        )

    def _exhaust_budget(self, holder: ThinkingBudgetStateHolder) -> list[int]:
        output = [self.THINK_START]
        self._step(holder, list(output))
        for _ in range(self.BUDGET):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"]
        return output

    def _accept_end_tokens(
        self,
        holder: ThinkingBudgetStateHolder,
        output: list[int],
        end_token_ids: list[int],
    ) -> None:
        for tok in end_token_ids:
            output.append(tok)
            self._step(holder, list(output))

    def test_single_token_end_reentry(self):
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, self.BUDGET)

        output = self._exhaust_budget(holder)
        self._accept_end_tokens(holder, output, self.THINK_END_SINGLE)

        for _ in range(3):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Second thinking block must also be budget-enforced"
        )

    def test_multi_token_end_reentry(self):
        holder = self._make_holder(self.THINK_END_MULTI)
        self._sync_batch(holder, self.BUDGET)

        output = self._exhaust_budget(holder)
        self._accept_end_tokens(holder, output, self.THINK_END_MULTI)

        assert not holder._state[0]["in_end"]

        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Immediate re-entry after multi-token end must be enforced"
        )

    def test_single_block_not_broken(self):
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, self.BUDGET)

        output = self._exhaust_budget(holder)
        self._accept_end_tokens(holder, output, self.THINK_END_SINGLE)

        for _ in range(20):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        assert not holder._state[0]["in_end"]
        assert not holder._state[0]["in_think"]


# --- Thinking budget natural-end re-entry tests (issue #45974) ---
# After a model naturally emits </think> before exhausting its budget,
# subsequent <think> blocks must still be tracked and budget-enforced.


class TestThinkingBudgetNaturalEndReentry:
    """Tests for thinking budget enforcement across multiple think blocks.

    Covers both natural-end re-entry (issue #45974) and forced-end re-entry
    (issue #43708).
    """

    THINK_START = 100
    THINK_END_SINGLE = [200]
    THINK_END_MULTI = [200, 201, 202]
    BUDGET = 10
    CONTENT_TOKEN = 50
    THINK_TOKEN = 60

    @staticmethod
    def _make_holder(end_token_ids):
        from tests.peer.logits_processors.vllm_sample_shim import (
            ThinkingBudgetStateHolder,
        )

        cfg = create_mock_reasoning_config(
            [TestThinkingBudgetNaturalEndReentry.THINK_START], end_token_ids
        )
        return ThinkingBudgetStateHolder(
            reasoning_config=cfg,
            max_num_seqs=8,
            num_spec_tokens=0,
            device=torch.device("cpu"),
            is_pin_memory=False,
        )

    @staticmethod
    def _sync_batch(holder, budget):
        from unittest.mock import MagicMock

        params = MagicMock()
        params.thinking_token_budget = budget
        batch_update = MagicMock(
            removed=[],
            added=[(0, params, None, [])],
            moved=[],
        )
        holder.sync_batch(batch_update)

    @staticmethod
    def _step(holder, output_tok_ids):
        holder.update_state(
            output_token_ids=[output_tok_ids],
            spec_token_ids=None,
            repeat_indices=None,
        )

    # --- Natural-end re-entry tests ---

    def test_natural_end_reentry_single_token(self):
        """After natural </think>, a new <think> block must be enforced."""
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, self.BUDGET)

        output = []

        # Block 1: 6 tokens (under budget) + natural </think>
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(6):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        output.append(self.THINK_END_SINGLE[0])
        self._step(holder, list(output))

        assert not holder._state[0]["in_end"]
        assert not holder._state[0]["in_think"]

        # Some content
        for _ in range(3):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        # Block 2: re-entry — should be budget-tracked
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET + 1):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Second thinking block after natural end must be budget-enforced"
        )

    def test_natural_end_reentry_multi_token(self):
        """Multi-token </think> natural end still allows Block 2 enforcement."""
        holder = self._make_holder(self.THINK_END_MULTI)
        self._sync_batch(holder, self.BUDGET)

        output = []

        # Block 1: 4 tokens + natural multi-token </think>
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(4):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        for tok in self.THINK_END_MULTI:
            output.append(tok)
            self._step(holder, list(output))

        assert not holder._state[0]["in_think"]

        # Content
        for _ in range(5):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        # Block 2: re-entry
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET + 1):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Second block after multi-token natural end must be enforced"
        )

    def test_natural_end_immediate_reentry(self):
        """Natural </think> followed immediately by <think> with no content."""
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, self.BUDGET)

        output = []

        # Block 1: 5 tokens + natural end
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(5):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        output.append(self.THINK_END_SINGLE[0])
        self._step(holder, list(output))

        # Immediate re-entry — NO content between blocks
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET + 1):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Immediate re-entry after natural end must be budget-enforced"
        )

    def test_multiple_natural_reentries(self):
        """Block 1 natural -> Block 2 natural -> Block 3 must be enforced."""
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, self.BUDGET)

        output = []

        # Block 1: 4 tokens + natural end
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(4):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        output.append(self.THINK_END_SINGLE[0])
        self._step(holder, list(output))

        # Content
        for _ in range(2):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        # Block 2: 3 tokens + natural end
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(3):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        output.append(self.THINK_END_SINGLE[0])
        self._step(holder, list(output))

        # Content
        for _ in range(2):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        # Block 3: exceed budget
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET + 1):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Third block after two natural ends must be budget-enforced"
        )

    def test_natural_then_forced_in_block_2(self):
        """Block 1 ends naturally, Block 2 exceeds budget -> forced end."""
        budget = 5
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, budget)

        output = []

        # Block 1: 3 tokens + natural end (under budget)
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(3):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        output.append(self.THINK_END_SINGLE[0])
        self._step(holder, list(output))

        assert not holder._state[0]["in_end"]

        # Content
        for _ in range(3):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        # Block 2: exceed budget
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(budget + 1):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Block 2 must trigger forced end after natural end in Block 1"
        )

    def test_budget_one_natural_end_reentry(self):
        """Budget = 1: natural end with 0 think tokens, re-entry enforced."""
        budget = 1
        holder = self._make_holder(self.THINK_END_SINGLE)
        self._sync_batch(holder, budget)

        output = []

        # Block 1: immediate natural end (0 think tokens)
        output.append(self.THINK_START)
        self._step(holder, list(output))
        output.append(self.THINK_END_SINGLE[0])
        self._step(holder, list(output))

        assert not holder._state[0]["in_end"]

        # Content
        for _ in range(3):
            output.append(self.CONTENT_TOKEN)
            self._step(holder, list(output))

        # Block 2: 2 think tokens (should be enforced at budget=1)
        output.append(self.THINK_START)
        self._step(holder, list(output))
        output.append(self.THINK_TOKEN)
        self._step(holder, list(output))
        output.append(self.THINK_TOKEN)
        self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Budget=1 must enforce after 1 token in re-entry block"
        )

    def test_partial_end_sequence_in_content(self):
        """Partial end sequence in content shouldn't trigger false exit."""
        holder = self._make_holder(self.THINK_END_MULTI)
        self._sync_batch(holder, self.BUDGET)

        output = []

        # Block 1: natural end with full sequence [200, 201, 202]
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(3):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))
        for tok in self.THINK_END_MULTI:
            output.append(tok)
            self._step(holder, list(output))

        # Content with partial end sequence [200, 201] but not [200, 201, 202]
        output.append(self.CONTENT_TOKEN)
        self._step(holder, list(output))
        output.append(200)
        self._step(holder, list(output))
        output.append(201)
        self._step(holder, list(output))
        output.append(self.CONTENT_TOKEN)
        self._step(holder, list(output))

        # Block 2: re-entry must still be enforced
        output.append(self.THINK_START)
        self._step(holder, list(output))
        for _ in range(self.BUDGET + 1):
            output.append(self.THINK_TOKEN)
            self._step(holder, list(output))

        assert holder._state[0]["in_end"], (
            "Partial end tokens in content must not prevent Block 2 enforcement"
        )

    # --- Forced-end re-entry tests ---
