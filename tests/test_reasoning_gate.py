"""Structured outputs behind a reasoning parser, in the scheduler (no model, no torch): the grammar waits for the
end of reasoning, as vLLM's StructuredOutputManager._get_constraint_bounds decides it.

While the request reasons its bitmask rows are unconstrained and its matcher reads nothing; the token that ends
the reasoning (`</think>`) is not fed to the grammar, the tokens after it are; Qwen3's implicit end
(`<tool_call>`) is content, so the grammar reads it, though its own row was free. Drafts are split the same
way: validated only after the end. A prompt that already ended the reasoning, `reasoning_ended=True` from the
server, or `enable_in_reasoning` constrain from the first token."""

from __future__ import annotations

from typing import Any

import pytest

from tests.sched_utils import create_scheduler
from tests.test_structured_scheduler import GatedBackend
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.request import Request
from tokenloom.core.structured_output import StructuredOutputManager
from tokenloom.reasoning import ReasoningParserManager
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams

THINK, END_THINK, TOOL_CALL, IM_START = 90, 91, 92, 93


class VocabTokenizer:
    """What a reasoning parser reads of a tokenizer: its vocabulary."""

    def get_vocab(self) -> dict[str, int]:
        return {"<think>": THINK, "</think>": END_THINK, "<tool_call>": TOOL_CALL, "<|im_start|>": IM_START}


def gated(parser: str | None = "deepseek_r1", enable_in_reasoning: bool = False, **kw: Any):
    sched = create_scheduler(num_blocks=64, block_size=4, **kw)
    backend = GatedBackend()
    backend.gate.set()
    factory = None
    if parser is not None:
        cls = ReasoningParserManager.get_reasoning_parser(parser)
        factory = lambda kwargs: cls(VocabTokenizer(), **kwargs)  # noqa: E731
    sched.structured_output_manager = StructuredOutputManager(lambda: backend, max_workers=1,
                                                              reasoner_factory=factory,
                                                              enable_in_reasoning=enable_in_reasoning)
    return sched


def constrained(grammar: str, prompt: list[int] | None = None, **kw: Any) -> Request:
    params = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(regex=grammar))
    return Request("c", prompt or [1, 2, 3, 4, 5, 6], params, **kw)


def run(sched, tokens: list[int]) -> tuple[list[Any], list[Any]]:
    """Step the one request through `tokens`; (each step's bitmask, the outputs)."""
    sched.structured_output_manager.executor.shutdown(wait=True)
    rows, outputs = [], []
    for token in tokens:
        so = sched.schedule()
        rows.append(so.grammar_bitmask)
        outputs += sched.update_from_output(so, ModelRunnerOutput(["c"], {"c": 0}, [[token]]))
    return rows, outputs


def test_the_grammar_waits_for_the_end_of_reasoning_and_never_reads_the_end_token() -> None:
    sched = gated()
    sched.add_request(constrained("7,8"))
    rows, outputs = run(sched, [11, 12, END_THINK, 7, 8])
    assert rows == [["all"], ["all"], ["all"], [{7}], [{8}]]
    assert outputs[-1].finish_reason == "stop"  # the grammar completed after the reasoning
    assert outputs[-1].error is None


def test_reasoning_tokens_the_grammar_would_refuse_are_not_an_error() -> None:
    sched = gated()
    sched.add_request(constrained("7,8"))
    _, outputs = run(sched, [99, 98, 97])
    assert all(out.finish_reason is None for out in outputs)
    assert not sched.requests["c"].structured_output_request.reasoning_ended


@pytest.mark.parametrize("how", ["prompt", "server", "enable_in_reasoning", "no parser"])
def test_constrained_from_the_first_token(how: str) -> None:
    sched = gated(parser=None if how == "no parser" else "deepseek_r1",
                  enable_in_reasoning=how == "enable_in_reasoning")
    prompt = [1, 2, THINK, 3, END_THINK, 4] if how == "prompt" else None
    sched.add_request(constrained("7,8", prompt, reasoning_ended=True if how == "server" else None))
    rows, outputs = run(sched, [7, 8])
    assert rows == [[{7}], [{8}]] and outputs[-1].finish_reason == "stop"


def test_the_server_saying_reasoning_goes_on_wins_over_the_prompt() -> None:
    sched = gated()
    sched.add_request(constrained("7,8", [1, THINK, 2, END_THINK], reasoning_ended=False))
    rows, _ = run(sched, [11, END_THINK, 7])
    assert rows == [["all"], ["all"], [{7}]]


def test_qwen3_tool_call_ends_reasoning_and_is_read_by_the_grammar() -> None:
    sched = gated("qwen3")
    sched.add_request(constrained(f"{TOOL_CALL},7", [IM_START, 1, 2]))
    rows, outputs = run(sched, [11, TOOL_CALL, 7])
    assert rows == [["all"], ["all"], [{7}]]  # <tool_call>'s own row was free; the grammar then read it
    assert outputs[-1].finish_reason == "stop"


def test_qwen3_with_thinking_disabled_is_constrained_from_the_first_token() -> None:
    sched = gated("qwen3")
    sched.add_request(constrained("7,8", [IM_START, 1], reasoning_parser_kwargs={
        "chat_template_kwargs": {"enable_thinking": False}}))
    rows, _ = run(sched, [7, 8])
    assert rows == [[{7}], [{8}]]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_drafts_are_validated_only_after_the_end_of_reasoning(parser: str) -> None:
    sched = gated(parser)
    req = constrained("7,8,9", [IM_START, 1, 2])
    sched.add_request(req)
    manager = sched.structured_output_manager
    manager.executor.shutdown(wait=True)
    assert manager.is_ready(req)
    # Reasoning drafts pass unchecked; after the end token the grammar keeps its longest valid prefix.
    assert manager.validate_tokens(req, [50, 51, END_THINK, 7, 8, 60, 9]) == [50, 51, END_THINK, 7, 8]
    assert manager.validate_tokens(req, [50, 51, 52]) == [50, 51, 52]
    assert manager.validate_tokens(req, [50, -1, 52]) == [50]
    # Rows: free up to and including the end token's position, then the grammar's, then the bonus token's.
    rows = manager.grammar_bitmask([req], {"c": [50, END_THINK, 7, 8]})
    assert rows == ["all", "all", {7}, {8}, {9}]
    rows = manager.grammar_bitmask([req], {"c": [50, 51]})
    assert rows == ["all", "all", "all"]
    assert req.structured_output_request.matcher.pos == 0  # the walk over the drafts was rolled back
    # Accepting a step's tokens across the end latches it: from then on everything is constrained.
    assert manager.accept_tokens(req, [50, END_THINK, 7])
    assert req.structured_output_request.reasoning_ended
    assert manager.grammar_bitmask([req], {"c": [8]}) == [{8}, {9}]


def test_each_request_gets_its_own_parser_built_with_its_kwargs() -> None:
    sched = gated("qwen3")
    req = constrained("7", [IM_START, 1], reasoning_parser_kwargs={"chat_template_kwargs": {"enable_thinking": False}})
    sched.add_request(req)
    manager = sched.structured_output_manager
    manager.executor.shutdown(wait=True)
    manager.is_ready(req)
    assert manager.constraint_bounds(req, []) == (0, 0)
    assert req.structured_output_request.reasoner.thinking_enabled is False
