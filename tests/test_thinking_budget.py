"""thinking_token_budget (vLLM 0.32's): the tracker's rule step by step, the engine's refusals, and vLLM's
value check. The budget in a running engine: tests/test_reasoning_server.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenloom import SamplingParams
from tokenloom.engine.input_processor import InputProcessor, InvalidRequestError
from tokenloom.exceptions import VLLMValidationError
from tokenloom.model.thinking_budget import ThinkingBudget

START, END = 90, 91
END2 = (91, 92)  # an end string of two tokens


def run(budget: int, prompt: list[int], model: list[int], end=(END,), steps: int = 8) -> list[int]:
    """The outputs of a model that would write `model` (then 0s), with the budget's forcing applied."""
    tokens = list(prompt)
    tracker = ThinkingBudget(budget, (START,), end, tokens, len(prompt))
    out: list[int] = []
    for i in range(steps):
        forced = tracker.forced_token(tokens)
        token = forced if forced is not None else (model[i] if i < len(model) else 0)
        tokens.append(token)
        out.append(token)
    return out


def test_the_end_is_forced_once_the_thinking_holds_the_budget() -> None:
    # The model opens thinking itself: three tokens of thinking, then </think> in place of the fourth.
    assert run(3, [1, 2], [START, 5, 6, 7, 8, 9, END, 10]) == [START, 5, 6, 7, END, 9, END, 10]
    # Budget 0: the end right after the start.
    assert run(0, [1], [START, 5, 6]) == [START, END, 6, 0, 0, 0, 0, 0]
    # Within the budget nothing changes; a natural end resets it, and a new block gets a new budget.
    assert run(2, [1], [START, 5, END, 6, START, 7, 8, 9]) == [START, 5, END, 6, START, 7, 8, END]
    # No start anywhere: no thinking, no budget to spend.
    assert run(0, [1], [5, 6, 7]) == [5, 6, 7, 0, 0, 0, 0, 0]


def test_a_prompt_that_opened_the_thinking_counts_its_tokens_after_the_start() -> None:
    # DeepSeek-R1's template ends the prompt with "<think>\n": the "\n" (here 4) is thinking already.
    assert run(2, [1, START, 4], [5, 6, 7]) == [5, END, 7, 0, 0, 0, 0, 0]
    assert run(1, [1, START, 4], [5, 6]) == [END, 6, 0, 0, 0, 0, 0, 0]
    assert run(1, [1, START, 4, END, 3], [5, 6]) == [5, 6, 0, 0, 0, 0, 0, 0]  # closed in the prompt


def test_an_end_string_of_several_tokens_is_forced_one_token_a_step() -> None:
    assert run(1, [1], [START, 5, 6, 7, 8], end=END2) == [START, 5, 91, 92, 8, 0, 0, 0]


def test_values_are_checked_in_vllms_words() -> None:
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    for bad in (-2, 1.5, True):
        with pytest.raises(VLLMValidationError, match="must be a non-negative integer or -1 for unlimited"):
            SamplingParams(thinking_token_budget=bad)


def processor(reasoning_token_ids=None, num_speculative_tokens: int = 0) -> InputProcessor:
    info = SimpleNamespace(reasoning_token_ids=reasoning_token_ids, num_speculative_tokens=num_speculative_tokens,
                           vocab_size=100, logits_processors=[])
    return InputProcessor(None, info)  # type: ignore[arg-type]


def test_the_engine_needs_a_reasoning_parser_and_refuses_drafts() -> None:
    params = SamplingParams(thinking_token_budget=4)
    with pytest.raises(InvalidRequestError, match=r"thinking_token_budget is set but reasoning_config is not "
                                                  r"configured. Please set --reasoning-parser"):
        processor()._resolve_thinking_budget(params)
    with pytest.raises(InvalidRequestError, match="not supported with speculative decoding"):
        processor(((START,), (END,)), num_speculative_tokens=3)._resolve_thinking_budget(params)
    resolved = processor(((START,), (END,)))._resolve_thinking_budget(params)
    assert resolved._thinking_token_ids == ((START,), (END,)) and params._thinking_token_ids is None  # a copy
