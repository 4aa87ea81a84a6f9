"""Tool-call parsing without a server: the Hermes parser whole and streamed (vLLM's algorithm), the
chat-level rules (content, finish_reason, parallel_tool_calls), vLLM's tool-flag 400s, and the
structural tags that force required / named calls (checked against xgrammar's own matcher)."""

from __future__ import annotations

import random

import pytest

from tokenloom.server.errors import APIError
from tokenloom.server.structured import structured_outputs_of
from tokenloom.server.tool_calls import StreamingToolParser, finish_reason, parse_output
from tokenloom.server.tools import tool_setup

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "strict": True, "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                       "required": ["tz"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Paris", "n": [1, {"a": "}"}]}}</tool_call>')


def stream(text: str, setup, pieces: list[str]) -> tuple[list[dict], StreamingToolParser]:
    parser = StreamingToolParser(setup)
    deltas = []
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, i == len(pieces) - 1)
        if delta:
            deltas.append(delta)
    return deltas, parser


def assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client gets by concatenating deltas (as the openai client's stream helpers do)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None, "a call announced twice"
                call["id"] = tc["id"]
                assert tc["type"] == "function"
            fn = tc.get("function") or {}
            if "name" in fn:
                call["name"] = fn["name"]
            call["arguments"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_streamed_calls_equal_the_whole_response(mode: str) -> None:
    setup = tool_setup([WEATHER, TIME], mode, None, "hermes")
    content, calls = parse_output(TWO_CALLS, setup)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    rng = random.Random(0)
    for pieces in [list(TWO_CALLS), [TWO_CALLS], *(random_pieces(TWO_CALLS, rng) for _ in range(30))]:
        deltas, parser = stream(TWO_CALLS, setup, pieces)
        s_content, s_calls = assemble(deltas)
        assert s_content == "Let me check.\n" == (content or "")
        # The model wrote the arguments in json.dumps's spacing, so they match as text, not only as JSON.
        assert [(c["name"], c["arguments"]) for c in s_calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert parser.finish_reason("stop") == "tool_calls"


def test_arguments_stream_in_pieces_after_the_name() -> None:
    setup = tool_setup([WEATHER, TIME], "auto", None, "hermes")
    deltas, _ = stream(TWO_CALLS, setup, list(TWO_CALLS))
    first = [tc for d in deltas for tc in d["tool_calls"] if tc["index"] == 0]
    assert first[0]["function"] == {"name": "get_weather"} and first[0]["id"].startswith("chatcmpl-tool-")
    assert len(first) > 5 and all(set(tc) == {"index", "function"} for tc in first[1:])
    # No closing brace of the outer object, no tag text, ever leaks into the arguments.
    assert "".join(tc["function"]["arguments"] for tc in first[1:]) == '{"city": "Paris"}'


def test_whole_response_rules() -> None:
    auto = tool_setup([WEATHER], "auto", None, "hermes")
    assert parse_output("no calls here", auto) == ("no calls here", [])
    assert parse_output("<tool_call>{not json}</tool_call>", auto) == ("<tool_call>{not json}</tool_call>", [])
    # A call without "arguments" is not a call (vLLM: KeyError → the text comes back as content).
    assert parse_output('<tool_call>{"name": "get_weather"}</tool_call>', auto)[1] == []
    content, calls = parse_output(' \n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', auto)
    assert content is None and calls[0]["function"]["arguments"] == "{}"
    required = tool_setup([WEATHER, TIME], "required", False, "hermes")
    content, calls = parse_output(TWO_CALLS, required)
    assert content == "Let me check.\n" and len(calls) == 1  # parallel_tool_calls: false keeps the first
    assert parse_output("", required) == ("", [])
    named = tool_setup([WEATHER, TIME], NAMED, None, "hermes")
    assert finish_reason("stop", named, calls) == "stop"
    assert finish_reason("stop", required, []) == "tool_calls"  # vLLM: required and stopped
    assert finish_reason("length", auto, calls) == "tool_calls" and finish_reason("length", auto, []) == "length"


def test_parallel_tool_calls_false_streams_only_the_first_call() -> None:
    setup = tool_setup([WEATHER, TIME], "required", False, "hermes")
    deltas, _ = stream(TWO_CALLS, setup, list(TWO_CALLS))
    _, calls = assemble(deltas)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_auto_tool_choice_without_a_parser_is_vllms_400() -> None:
    with pytest.raises(APIError, match='"auto" tool choice requires --enable-auto-tool-choice and '
                                       "--tool-call-parser to be set") as err:
        tool_setup([WEATHER], None, None, None, tool_choice_given=False)  # tools given: "auto"
    assert err.value.status == 400
    # vLLM: "required" and a named function need no parser (structured outputs force them, JSON reads them).
    required = tool_setup([WEATHER], "required", None, None)
    named = tool_setup([WEATHER], NAMED, None, None)
    assert (required.mode, named.mode, named.named) == ("required", "named", "get_weather")
    assert required.parses_calls and named.parses_calls and required.parser is None
    # "none", and an explicit null (vLLM keeps it None: the tools are shown, nothing is parsed), are fine.
    assert tool_setup([WEATHER], "none", None, None).mode == "none"
    assert tool_setup([WEATHER], None, None, None, tool_choice_given=True).mode == "none"
    assert tool_setup([WEATHER], None, None, "hermes", tool_choice_given=True).mode == "auto"
    # An empty tool list is no tools to vLLM: tool_choice stays "none"; "required" cannot be met.
    assert tool_setup([], None, None, None, tool_choice_given=False).mode == "none"
    with pytest.raises(APIError, match="tools contains no function tool"):
        tool_setup([], "required", None, "hermes")


def test_server_config_checks_the_flags_as_vllm() -> None:
    from tokenloom.server.config import ServerConfig

    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True).validate_tools()
    with pytest.raises(ValueError, match=r"invalid tool call parser: nope \(chose from \{ hermes,llama3_json,"
                                         r"llama4_json,mistral,phi4_mini_json,pythonic,qwen3_coder,qwen3_json,"
                                         r"qwen3_xml \}\)"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="nope").validate_tools()
    ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes").validate_tools()
    ServerConfig(tool_call_parser="nope").validate_tools()  # vLLM checks the name only with the flag on


def _accepts(so, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(so.structural_tag), text)


def test_required_and_named_are_forced_with_a_structural_tag() -> None:
    required = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", None, "hermes"))
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    assert _accepts(required, one) and _accepts(required, two)
    assert not _accepts(required, "Sure.") and not _accepts(required, one.replace("get_weather", "get_wether"))
    # A forced call's arguments fit the tool's schema, strict tool (get_time) or not (get_weather): issue 35's
    # non-strict get_weather(city) wrote {"city": {"type": "string", ...}} when they were any JSON value.
    assert not _accepts(required, '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>')
    assert not _accepts(required, '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>')
    assert not _accepts(required, '<tool_call>{"name": "get_weather", "arguments": {"city": {"type": "string"}}}'
                                  '</tool_call>')
    strict = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", None, "hermes"), "parameter")
    assert not _accepts(strict, '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>')
    single = structured_outputs_of({}, tool_setup([WEATHER, TIME], "required", False, "hermes"))
    assert _accepts(single, one) and not _accepts(single, two)
    named = structured_outputs_of({"response_format": {"type": "json_object"}},  # replaced, as vLLM
                                  tool_setup([WEATHER, TIME], NAMED, None, "hermes"))
    assert _accepts(named, one) and not _accepts(named, two) and not _accepts(named, '{"a": 1}')


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_forced_calls_cap_the_whitespace_in_their_arguments(parser: str) -> None:
    # JSON allows any whitespace between tokens, and a small model can write newlines inside `{}` until
    # max_tokens: a forced call (required / named) allows FORCED_CALL_MAX_WHITESPACE (8) in a row.
    from tokenloom.server.tool_grammar import FORCED_CALL_MAX_WHITESPACE

    assert FORCED_CALL_MAX_WHITESPACE == 8

    def call(name: str, args: str) -> str:
        if parser == "hermes":
            return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
        return f'{{"name": "{name}", "parameters": {args}}}'

    pretty = call("get_weather", '{\n  "city": "Paris"\n}')
    for choice in ("required", NAMED):
        so = structured_outputs_of({}, tool_setup([WEATHER, TIME], choice, None, parser))
        assert _accepts(so, pretty) and _accepts(so, call("get_weather", "{" + " " * 8 + '"city": "Paris"}'))
        assert not _accepts(so, call("get_weather", "{" + " " * 9 + '"city": "Paris"}'))
        assert not _accepts(so, call("get_weather", '{"city":' + "\n" * 9 + '"Paris"}'))
    # "auto" (the model may answer in text instead) keeps JSON's whitespace, as vLLM.
    auto = structured_outputs_of({}, tool_setup([WEATHER, TIME], "auto", None, parser))
    assert _accepts(auto, call("get_time", "{" + " " * 20 + '"tz": "CET"}'))


def test_auto_is_free_unless_a_tool_is_strict() -> None:
    assert structured_outputs_of({}, tool_setup([WEATHER], "auto", None, "hermes")) is None
    # An explicit null is parsed as "auto" but never constrained (vLLM: need_tool_calling is false).
    assert structured_outputs_of({}, tool_setup([WEATHER, TIME], None, None, "hermes", True)) is None
    so = structured_outputs_of({}, tool_setup([WEATHER, TIME], "auto", None, "hermes"))
    assert _accepts(so, "Just text.") and _accepts(so, 'Text <tool_call>{"name": "get_time", "arguments": '
                                                       '{"tz": "CET"}}</tool_call>')
    assert not _accepts(so, 'Text <tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    both = structured_outputs_of({"response_format": {"type": "json_object"}},
                                 tool_setup([WEATHER, TIME], "auto", None, "hermes"))
    assert _accepts(both, '{"a": 1}') and _accepts(both, '<tool_call>{"name": "get_weather", "arguments": 1}'
                                                         "</tool_call>")
    assert not _accepts(both, "Just text.")
    # Without strict tools a response_format stays the request's own constraint.
    own = structured_outputs_of({"response_format": {"type": "json_object"}},
                                tool_setup([WEATHER], "auto", None, "hermes"))
    assert own is not None and own.json_object
