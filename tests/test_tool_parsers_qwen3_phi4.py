"""The qwen3_coder and phi4_mini_json tool parsers beyond vLLM's own tests (vendored in tests/peer/tool_parsers/):
as the server streams them (the last delta final, pieces of any size) they add up to the whole response;
qwen3_coder's forced calls through xgrammar's builtin "qwen_3_coder" tag, read back typed by the schema;
phi4_mini_json's through vLLM's JSON forms; neither refused at start-up on a vocabulary without their
markers (vLLM checks none); and a parser from `--tool-parser-plugin`, vLLM's way of adding one."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from tests.test_tool_parsers_llama_pythonic import Reconstructor, random_pieces
from tokenloom.server.structured import structured_outputs_of
from tokenloom.server.tool_calls import StreamingToolParser, parse_output, tools_system_prompt
from tokenloom.server.tool_parsers import ToolParserManager, check_tokenizer, get_tool_parser
from tokenloom.server.tools import tool_setup

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"]}}}
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}

QWEN_ONE = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"units\": \"metric\", \"hours\": [1, 2]}\n"
            "</parameter>\n</function>\n</tool_call>")
QWEN_TWO = QWEN_ONE + ("\n<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n"
                       "</tool_call>")
PHI_TWO = ('functools[{"name": "get_weather", "arguments": {"city": "San Francisco, CA", "days": 3, '
           '"opts": {"units": "metric", "hours": [1, 2]}}},\n {"name": "get_time", "parameters": {"tz": "CET"}}]')


def served(parser: str, pieces: list[str], tools=(WEATHER, TIME), choice="auto") -> tuple[Reconstructor, str]:
    """As the server streams one choice: every piece through StreamingToolParser, the last one final."""
    stream = StreamingToolParser(tool_setup(list(tools), choice, None, parser))
    rec = Reconstructor(one_tool_per_delta=False)
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, i == len(pieces) - 1)
        if delta is not None:
            rec.append(delta)
    return rec, stream.finish_reason("stop")


def whole(parser: str, text: str, tools=(WEATHER, TIME), choice="auto"):
    content, calls = parse_output(text, tool_setup(list(tools), choice, None, parser))
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("parser, text", [("qwen3_coder", QWEN_TWO), ("phi4_mini_json", PHI_TWO)])
def test_streamed_pieces_add_up_to_the_whole_response(parser: str, text: str) -> None:
    for prefix in ("", "Let me check. "):
        content, calls = whole(parser, prefix + text)
        assert [n for n, _ in calls] == ["get_weather", "get_time"]
        # Typed by the schema (qwen3_coder's values are text until then), and json.dumps'd alike.
        assert json.loads(calls[0][1]) == {"city": "San Francisco, CA", "days": 3,
                                           "opts": {"units": "metric", "hours": [1, 2]}}
        rng = random.Random(3)
        for pieces in [list(prefix + text), *(random_pieces(prefix + text, rng) for _ in range(25))]:
            rec, finish = served(parser, pieces)
            assert [(c["name"], c["arguments"]) for c in rec.calls] == calls, pieces
            assert finish == "tool_calls"
            # The text before the calls streams as it comes; the whole response keeps it (qwen3_coder) or,
            # as vLLM's phi4_mini_json does, drops it.
            assert rec.content.strip() == prefix.strip()
            assert content == (prefix.strip() or None if parser == "qwen3_coder" else None)


@pytest.mark.parametrize("suffix", ["\n</tool_call>", "\nDone, see above."])
def test_qwen3_coder_text_after_a_call_is_not_content_whole_or_streamed(suffix: str) -> None:
    # SmolLM2 under the forced-call grammar added a stray "</tool_call>" after the call; vLLM drops such
    # text from the whole response but streams it as content. Here neither has it.
    content, calls = whole("qwen3_coder", "Sure." + QWEN_ONE + suffix)
    assert content == "Sure." and [n for n, _ in calls] == ["get_weather"]
    for pieces in (list("Sure." + QWEN_ONE + suffix), ["Sure.", QWEN_ONE + suffix]):
        rec, _ = served("qwen3_coder", pieces)
        assert rec.content == "Sure." and [(c["name"], c["arguments"]) for c in rec.calls] == calls


@pytest.mark.parametrize("cut_after, args", [
    ("<parameter=days>\n3", {"city": "San Francisco, CA", "days": 3}),
    ("<parameter=city>\nSan Fr", {"city": "San Fr"}),
    ("</parameter>\n<param", {"city": "San Francisco, CA"}),
])
def test_qwen3_coder_output_cut_inside_a_call_gives_the_same_valid_json(cut_after: str, args: dict) -> None:
    # max_tokens ends the output inside a call: the whole response reads the parameter being written, and
    # the stream's last delta (finish_streaming) completes the arguments to the same JSON. vLLM drops that
    # parameter from the whole response, and its stream's arguments never close.
    text = QWEN_ONE[:QWEN_ONE.index(cut_after) + len(cut_after)]
    _, calls = whole("qwen3_coder", text)
    assert json.loads(calls[0][1]) == args
    for pieces in (list(text), random_pieces(text, random.Random(5))):
        rec, _ = served("qwen3_coder", pieces)
        assert [(c["name"], c["arguments"]) for c in rec.calls] == calls


@pytest.mark.parametrize("parser, text", [
    ("qwen3_coder", "Five < six, and <tool"),  # a marker that never formed is text at the end
    ("phi4_mini_json", "I like functools"),
    ("phi4_mini_json", "Use functools[] here"),  # an empty array: no call, the text is content
    ("phi4_mini_json", 'functools[{"name": "f"}]'),  # not a call: no arguments
])
def test_text_without_a_call_is_content_whole_and_streamed(parser: str, text: str) -> None:
    assert whole(parser, text) == (text, [])
    for pieces in (list(text), [text]):
        rec, finish = served(parser, pieces)
        assert rec.calls == [] and rec.content == text and finish == "stop"


def _accepts(so, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(so.structural_tag), text)


def test_qwen3_coder_forced_calls_use_xgrammars_qwen_3_coder_tag() -> None:
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
          "</parameter>\n</function>\n</tool_call>"
    two = one + "\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>"
    required = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", None, "qwen3_coder"))
    assert _accepts(required, one) and _accepts(required, two)
    assert not _accepts(required, "Sure." + one) and not _accepts(required, one.replace("\n3\n", "\nthree\n"))
    single = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", False, "qwen3_coder"))
    assert _accepts(single, one) and not _accepts(single, two)
    named = structured_outputs_of({}, tool_setup([WEATHER, TIME], NAMED_TIME, None, "qwen3_coder"))
    assert _accepts(named, two[len(one) + 1:]) and not _accepts(named, one)
    # auto: free unless a tool is strict, then a call after the trigger is held to its schema.
    assert structured_outputs_of({}, tool_setup([WEATHER], "auto", None, "qwen3_coder")) is None
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    auto = structured_outputs_of({}, tool_setup([strict], "auto", None, "qwen3_coder"))
    assert _accepts(auto, "Just text.") and _accepts(auto, "Ok. " + one)
    assert not _accepts(auto, "Ok. " + one.replace("\n3\n", "\nthree\n"))
    # What the grammar lets through, the parser reads back: calls of the tools, typed by their schemas.
    for choice, text in (("required", two), (NAMED_TIME, two[len(one) + 1:])):
        content, calls = parse_output(text, tool_setup([WEATHER, TIME], choice, None, "qwen3_coder"))
        assert content == ""
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    assert json.loads(parse_output(one, tool_setup([WEATHER], "required", None, "qwen3_coder"))[1][0]
                      ["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_phi4_mini_forced_calls_use_vllms_json_forms() -> None:
    assert get_tool_parser("phi4_mini_json").supports_required_and_named
    assert not get_tool_parser("qwen3_coder").supports_required_and_named
    required = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", None, "phi4_mini_json"))
    assert required is not None and required.json["type"] == "array" and required.structural_tag is None
    text = '[{"name": "get_time", "parameters": {"tz": "CET"}}]'
    assert parse_output(text, tool_setup([WEATHER, TIME], "required", None, "phi4_mini_json"))[1][0]["function"] \
        == {"name": "get_time", "arguments": '{"tz": "CET"}'}
    named = structured_outputs_of({}, tool_setup([WEATHER, TIME], NAMED_TIME, None, "phi4_mini_json"))
    assert named is not None and named.json == TIME["function"]["parameters"]


def test_the_prompt_shown_to_a_template_without_tools_asks_for_the_parsers_format() -> None:
    assert "<function=example_function_name>" in tools_system_prompt([WEATHER], "qwen3_coder")
    assert 'functools[{"name": <function-name>' in tools_system_prompt([WEATHER], "phi4_mini_json")


def test_neither_needs_a_token_at_start_up() -> None:
    # vLLM checks no token for these formats: they are read from the text, so SmolLM2's vocabulary serves.
    from tokenloom.model.tokenizer import load_tokenizer

    for name in ("qwen3_coder", "qwen3_xml", "phi4_mini_json"):
        check_tokenizer(name, load_tokenizer(None), "SmolLM2-135M-Instruct")


PLUGIN = '''
import json
from tokenloom.server.tool_parsers import (ExtractedToolCallInformation, FunctionCall, ToolCall, ToolParser,
                                           ToolParserManager)


@ToolParserManager.register_module("shouty")
class ShoutyToolParser(ToolParser):
    """CALL name ARGS-JSON on one line."""

    def extract_tool_calls(self, model_output, request):
        if not model_output.startswith("CALL "):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        name, args = model_output[5:].split(" ", 1)
        return ExtractedToolCallInformation(tools_called=True, content=None, tool_calls=[
            ToolCall(function=FunctionCall(name=name, arguments=json.dumps(json.loads(args))))])
'''


def test_a_tool_parser_plugin_registers_under_its_name(tmp_path) -> None:
    from tokenloom.server.config import ServerConfig

    path = tmp_path / "my_tool_parsers.py"
    path.write_text(PLUGIN)
    try:
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="shouty",
                     tool_parser_plugin=str(path)).validate_tools()
        assert "shouty" in ToolParserManager.list_registered()
        content, calls = parse_output('CALL get_time {"tz":"CET"}', tool_setup([TIME], "auto", None, "shouty"))
        assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"tz": "CET"}'}
    finally:
        ToolParserManager.lazy_parsers.pop("shouty", None)
        ToolParserManager.tool_parsers.pop("shouty", None)
    with pytest.raises(ValueError, match=r"--tool-parser-plugin '/no/such.py' is neither an importable module "):
        ServerConfig(tool_parser_plugin="/no/such.py").validate_tools()
