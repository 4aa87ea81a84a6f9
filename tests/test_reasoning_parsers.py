"""Reasoning parsers beyond vLLM's own tests (tests/peer/reasoning): the registry and plugins, the start-up
refusals in vLLM's words, the engine arguments, Qwen3's turn boundaries and token counts, and the server's
streaming composition (tokenloom/server/reasoning.py) on its own. No model."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from tokenloom.config import ConfigError, EngineConfig, StructuredOutputsConfig
from tokenloom.reasoning import (
    ReasoningParser,
    ReasoningParserManager,
    check_reasoning_tokenizer,
    resolve_reasoning_parser,
)
from tokenloom.reasoning.protocol import DeltaMessage
from tokenloom.server.reasoning import OutputParser, reasoning_ended
from tokenloom.server.tools import tool_setup

THINK, END, TOOL, TOOL_END, IM_START, IM_END = 90, 91, 92, 93, 94, 95
VOCAB = {"<think>": THINK, "</think>": END, "<tool_call>": TOOL, "</tool_call>": TOOL_END, "<|im_start|>": IM_START,
         "<|im_end|>": IM_END}


class Tokenizer:
    """What the parsers read of a tokenizer: its vocabulary, and (optionally) its special tokens."""

    def __init__(self, vocab: dict[str, int] | None = None, special: dict[str, int] | None = None) -> None:
        self.vocab = VOCAB if vocab is None else vocab
        if special is not None:
            self.all_special_tokens, self.all_special_ids = list(special), list(special.values())

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def parser(name: str, tokenizer: Any = None, **kwargs: Any) -> ReasoningParser:
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer or Tokenizer(), **kwargs)


# Registry, plugins, start-up checks -----------------------------------------------------------------
def test_unknown_names_are_refused_in_vllms_words() -> None:
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.list_registered())
    with pytest.raises(KeyError, match=r"invalid reasoning parser: nope \(chose from \{ deepseek_r1,qwen3"):
        resolve_reasoning_parser("nope")
    with pytest.raises(ConfigError, match="Reasoning parser 'nope' not found. Available parsers: deepseek_r1, qwen3"):
        EngineConfig(reasoning_parser="nope")


def test_a_parser_whose_tokens_the_vocabulary_lacks_is_refused_at_start_up() -> None:
    cls = resolve_reasoning_parser("deepseek_r1")
    with pytest.raises(ValueError, match=r"--reasoning-parser deepseek_r1 cannot be used with the tokenizer of "
                                         r"'m': DeepSeekR1ReasoningParser reasoning parser could not locate think "
                                         r"start/end tokens in the tokenizer!"):
        check_reasoning_tokenizer("deepseek_r1", cls, Tokenizer({"a": 1}), "m")
    check_reasoning_tokenizer("deepseek_r1", cls, Tokenizer(), "m")
    # vLLM's Qwen3 engine accepts any vocabulary: without single-token tags it reads them in the text.
    qwen3 = parser("qwen3", Tokenizer({"a": 1}))
    assert qwen3.extract_reasoning("<think>x</think>y", None) == ("x", "y")


def test_the_flags_reach_the_structured_outputs_config_and_skip_tokenizer_init_is_refused() -> None:
    so = EngineConfig(reasoning_parser="qwen3").structured_outputs_config
    assert (so.reasoning_parser, so.enable_in_reasoning) == ("qwen3", False)
    so = EngineConfig(structured_outputs_config={"reasoning_parser": "deepseek_r1", "enable_in_reasoning": True}
                      ).structured_outputs_config
    assert (so.reasoning_parser, so.enable_in_reasoning) == ("deepseek_r1", True)
    with pytest.raises(ConfigError, match="a reasoning parser reads the generated text, which skip_tokenizer_init"):
        EngineConfig(reasoning_parser="qwen3", skip_tokenizer_init=True)


def test_a_plugin_file_registers_its_parser_for_the_flag(tmp_path) -> None:
    plugin = tmp_path / "my_reasoning_plugin.py"
    plugin.write_text(textwrap.dedent("""
        from tokenloom.reasoning import ReasoningParserManager
        from tokenloom.reasoning.basic_parsers import BaseThinkingReasoningParser

        @ReasoningParserManager.register_module("my_think")
        class MyThink(BaseThinkingReasoningParser):
            start_token = "<think>"
            end_token = "</think>"
    """))
    try:
        config = EngineConfig(reasoning_parser="my_think", reasoning_parser_plugin=str(plugin))
        assert config.structured_outputs_config.reasoning_parser_plugin == str(plugin)
        assert parser("my_think").extract_reasoning("a</think>b", None) == ("a", "b")
        with pytest.raises(KeyError, match="already registered"):
            ReasoningParserManager.register_module("my_think", force=False, module=type(parser("my_think")))
    finally:
        ReasoningParserManager.lazy_parsers.pop("my_think", None)
        ReasoningParserManager.reasoning_parsers.pop("my_think", None)


def test_serve_stops_on_an_unknown_parser_before_loading(capsys) -> None:
    from tests.test_server_harness import free_port
    from tokenloom.cli import main

    assert main(["serve", "--reasoning-parser", "nope", "--port", str(free_port())]) == 1
    assert "tokenloom serve: invalid reasoning parser: nope (chose from { deepseek_r1,qwen3" in capsys.readouterr().err


def test_structured_outputs_config_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match="reasoning_parser_plugin must be a string"):
        StructuredOutputsConfig(reasoning_parser_plugin=3)  # type: ignore[arg-type]


# Qwen3's rules beyond vLLM's tests ------------------------------------------------------------------
def test_qwen3_looks_back_only_to_the_last_turn() -> None:
    qwen3 = parser("qwen3")
    # An earlier turn's </think> does not end this turn's reasoning; this turn's start reopens it.
    assert not qwen3.is_reasoning_end([IM_START, 5, END, 6, IM_END, IM_START, 7])
    assert qwen3.is_reasoning_end([IM_START, 7, THINK, 8, END, 9])
    assert not qwen3.is_reasoning_end([IM_START, 7, END, THINK, 8])
    assert qwen3.is_reasoning_end([IM_START, 7, TOOL, 8])  # a tool call ended it
    # enable_thinking false: the answer is content unless the turn opens a think block... which it cannot.
    plain = parser("qwen3", chat_template_kwargs={"enable_thinking": False})
    assert plain.is_reasoning_end([IM_START, 7]) and plain.count_reasoning_tokens([5, 6]) == 0
    assert plain.extract_content_ids([5, 6]) == [5, 6]


@pytest.mark.parametrize(("ids", "thinking", "ended"), [
    # vLLM's tests/parser/engine/test_qwen3_reasoning.py::TestIsReasoningEndDerivedFromGrammar, its table.
    ([THINK, 1, END], True, True), ([THINK, 1, TOOL], True, True),
    ([THINK, 1], True, False), ([END, THINK, 1], True, False),
    ([IM_END, IM_START, 1], True, False), ([], True, False),
    # Thinking off: a <think> the template left behind is inert, and a silent tail has ended.
    ([THINK, 1], False, True), ([END, THINK, 1], False, True), ([IM_END, IM_START, 1], False, True), ([], False, True),
    # ... and its other classes: a tool example in the prompt before the generation's <think> is not an end.
    ([TOOL, 100, THINK], True, False), ([THINK, 1, TOOL, 2, TOOL_END], True, True),
])
def test_qwen3_is_reasoning_end_as_vllms_engine(ids: list[int], thinking: bool, ended: bool) -> None:
    qwen3 = parser("qwen3", chat_template_kwargs={"enable_thinking": thinking})
    assert qwen3.is_reasoning_end(ids) is ended


def test_qwen3_counts_content_ids_and_ends() -> None:
    qwen3 = parser("qwen3")
    assert qwen3.count_reasoning_tokens([THINK, 5, 6, END, 7]) == 2
    assert qwen3.count_reasoning_tokens([5, 6, TOOL, 7, TOOL_END]) == 2
    assert qwen3.extract_content_ids([5, END, 7, 8]) == [7, 8]
    assert qwen3.extract_content_ids([5, TOOL, 7]) == [TOOL, 7]  # an implicit end is content itself
    assert qwen3.find_reasoning_end([5, END, 7]) == (1, False)
    assert qwen3.find_reasoning_end([5, TOOL, 7]) == (1, True)
    assert qwen3.find_reasoning_end([5, 6]) == (2, False)


def test_qwen3_drops_other_special_tokens_and_holds_back_a_partial_tag() -> None:
    qwen3 = parser("qwen3", Tokenizer(special={"<|im_end|>": IM_END, "<think>": THINK}))
    # Whole: special-token text dropped (vLLM's parsers ask for special tokens in the text: adjust_request).
    assert qwen3.extract_reasoning("a<|im_end|>b</think>c<|im_end|>", None) == ("ab", "c")
    # Streamed as text only (no ids): "</th" might be the end tag, so it waits.
    first = qwen3.extract_reasoning_streaming("", "a</th", "a</th", [], [], [])
    assert first == DeltaMessage(reasoning="a")
    assert qwen3.extract_reasoning_streaming("", "", "ink>b", [], [], []) == DeltaMessage(content="b")


def test_qwen3_adjust_request_keeps_special_tokens() -> None:
    class Req:
        skip_special_tokens = True

    assert parser("qwen3").adjust_request(Req()).skip_special_tokens is False


# The server's composition -----------------------------------------------------------------------------
def stream(out: OutputParser, pieces: list[tuple[str, list[int]]], prompt: list[int]) -> list[dict[str, Any]]:
    deltas = []
    for i, (text, ids) in enumerate(pieces):
        delta = out.parse_delta(text, ids, prompt, finished=i == len(pieces) - 1)
        if delta is not None:
            deltas.append(delta.as_delta())
    return deltas


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_streamed_reasoning_then_content(name: str) -> None:
    out = OutputParser(parser(name), None)
    pieces = [("I", [5]), (" think", [6]), ("</think>", [END]), ("Yes", [7]), (".", [8])]
    assert stream(out, pieces, [IM_START, 1]) == [
        {"reasoning": "I"}, {"reasoning": " think"}, {"content": "Yes"}, {"content": "."}]


def test_a_prompt_that_ended_the_reasoning_makes_every_delta_content() -> None:
    out = OutputParser(parser("qwen3"), None)
    assert stream(out, [("Hi", [5]), ("!", [6])], [IM_START, THINK, END]) == [{"content": "Hi"}, {"content": "!"}]


def test_what_the_parser_held_back_comes_out_at_the_end() -> None:
    out = OutputParser(parser("qwen3", Tokenizer({"a": 1})), None)  # tags only in the text: "<" may start one
    assert stream(out, [("a <", [1]), ("", [])], [1]) == [{"reasoning": "a "}, {"reasoning": "<"}]


def test_include_reasoning_false_sends_only_content() -> None:
    out = OutputParser(parser("qwen3"), None, include_reasoning=False)
    assert stream(out, [("x", [5]), ("</think>y", [END, 6])], [1]) == [{"content": "y"}]
    assert out.parse("x</think>y") == (None, "y", [])


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_tool_calls_are_parsed_from_the_content_after_the_reasoning(name: str) -> None:
    tools = tool_setup([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "auto",
                       None, "hermes")
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    reasoning, content, calls = OutputParser(parser(name), tools).parse(f"Plan.</think>{call}")
    assert (reasoning, content, [c["function"]["name"] for c in calls]) == ("Plan.", None, ["f"])
    # A call written inside the reasoning (never closed by </think>, R1's rule) is not a call.
    if name == "deepseek_r1":
        assert OutputParser(parser(name), tools).parse(f"Plan {call}")[2] == []
    out = OutputParser(parser(name), tools)
    deltas = stream(out, [("Plan.", [5]), ("</think>", [END]), (call, [TOOL, 7, TOOL_END])], [IM_START])
    assert deltas[0] == {"reasoning": "Plan."}
    assert [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "name" in tc["function"]] \
        == ["f"]
    assert out.finish_reason("stop") == "tool_calls"


def test_the_engine_is_told_whether_the_prompt_ended_the_reasoning() -> None:
    qwen3 = parser("qwen3")
    assert reasoning_ended(True, qwen3, [IM_START, 1]) is False
    assert reasoning_ended(True, qwen3, [IM_START, THINK, END]) is True
    assert reasoning_ended(False, qwen3, [IM_START, 1]) is True  # vLLM: hidden reasoning, constrained from the start
    assert reasoning_ended(True, None, [1]) is None
