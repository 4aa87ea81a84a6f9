"""`--tool-call-parser mistral` on Hugging Face tokenizers (tokenloom/server/tool_parsers/mistral.py): both of
vLLM 0.32's formats whole and streamed token by token, Mistral's 9-character ids, the forced-call schema and
the start-up check. The tokenizers are SmolLM2's with `[TOOL_CALLS]` (pre-v11, as Mistral-7B-Instruct-v0.3)
or `[TOOL_CALLS]` and `[ARGS]` (v11+) added as special tokens, standing in for the Hub's.
"""

from __future__ import annotations

import json

import pytest

from tests.peer.tool_parsers.vllm_shim import local_tokenizer
from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.tool_grammar import tool_structured_outputs
from tokenloom.server.tool_parsers import ToolParserTokenizerError, check_tokenizer
from tokenloom.server.tool_parsers.mistral import MistralToolParser, is_valid_mistral_tool_call_id
from tokenloom.server.tools import ToolSetup

AUTO = {"tool_choice": "auto"}
REQUIRED = {"tool_choice": "required"}
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}


@pytest.fixture(scope="module")
def pre_v11_tok():
    return local_tokenizer(special=("[TOOL_CALLS]",))


@pytest.fixture(scope="module")
def v11_tok():
    return local_tokenizer(special=("[TOOL_CALLS]", "[ARGS]"))


def stream(tok, text: str, request=AUTO) -> tuple[str, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) streamed token by token, as the server feeds the parser."""
    from tokenloom.server.tool_calls import _finish

    parser = MistralToolParser(tok)
    ids = tok.encode(text, add_special_tokens=False)
    previous, content, calls = "", "", {}
    for i, token in enumerate(ids):
        current = tok.decode(ids[: i + 1], skip_special_tokens=False)
        message = parser.extract_tool_calls_streaming(previous, current, current[len(previous):], ids[:i],
                                                      ids[: i + 1], [token], request)
        if i == len(ids) - 1:
            message = _finish(parser, message)
        previous = current
        if message is None:
            continue
        content += message.content or ""
        for tc in message.tool_calls:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name is not None
                calls[tc.index] = [tc.id, tc.function.name, ""]
            calls[tc.index][2] += tc.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


PRE_V11 = [
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5}}]', "", [("add", {"a": 3.5})]),
    ('Sure.[TOOL_CALLS] [{"arguments": {"city": "Paris"}, "name": "get_weather"}, {"name": "add", "arguments": '
     '{"a": 1}}]', "Sure.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    ('[TOOL_CALLS] {"name": "add", "arguments": "{\\"a\\": 2}"}', "", [("add", {"a": 2})]),
]


@pytest.mark.parametrize("text,content,expected", PRE_V11)
def test_pre_v11_whole_and_streamed(pre_v11_tok, text, content, expected) -> None:
    info = MistralToolParser(pre_v11_tok).extract_tool_calls(text, AUTO)
    assert info.tools_called and info.content == (content or None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == expected
    assert all(is_valid_mistral_tool_call_id(c.id) for c in info.tool_calls)
    streamed_content, calls = stream(pre_v11_tok, text)
    assert streamed_content == content
    assert [(name, json.loads(args)) for _, name, args in calls] == expected
    assert all(is_valid_mistral_tool_call_id(call_id) for call_id, _, _ in calls)


def test_pre_v11_malformed_json_is_content(pre_v11_tok) -> None:
    info = MistralToolParser(pre_v11_tok).extract_tool_calls("[TOOL_CALLS] not json", AUTO)
    assert (info.tools_called, info.content) == (False, "not json")
    info = MistralToolParser(pre_v11_tok).extract_tool_calls("no call here", AUTO)
    assert (info.tools_called, info.content) == (False, "no call here")


def test_pre_v11_text_after_the_calls_streams_as_content(pre_v11_tok) -> None:
    content, calls = stream(pre_v11_tok, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}] done')
    assert content == " done" and [(n, a) for _, n, a in calls] == [("add", '{"a": 1}')]


V11 = [
    ('[TOOL_CALLS]add[ARGS]{"a": 3.5}', None, [("add", {"a": 3.5})]),
    ('Let me check.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}', "Let me check.",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} trailing words', None, [("get_weather", {"city": "Paris"})]),
    ("[TOOL_CALLS]no_args", None, [("no_args", {})]),
]


@pytest.mark.parametrize("text,content,expected", V11)
def test_v11_whole_and_streamed(v11_tok, text, content, expected) -> None:
    info = MistralToolParser(v11_tok).extract_tool_calls(text, AUTO)
    assert info.tools_called and info.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == expected
    streamed_content, calls = stream(v11_tok, text)
    assert streamed_content == (content or "")
    assert [(name, json.loads(args)) for _, name, args in calls] == expected
    assert all(is_valid_mistral_tool_call_id(call_id) for call_id, _, _ in calls)


def test_v11_unparsable_arguments_kept_as_written(v11_tok) -> None:
    info = MistralToolParser(v11_tok).extract_tool_calls("bash[TOOL_CALLS]{not json", AUTO)
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [("", "{not json")]
    assert info.content == "bash"


@pytest.mark.parametrize("fixture", ["pre_v11_tok", "v11_tok"])
def test_forced_bare_array_is_read_as_calls(fixture, request) -> None:
    """tool_choice required / named force vLLM's pre-v11 array (no marker); both formats read it."""
    tok = request.getfixturevalue(fixture)
    text = '[{"name": "add", "arguments": {"a": 1}}]'
    info = MistralToolParser(tok).extract_tool_calls(text, REQUIRED)
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == [("add", '{"a": 1}')]
    named = {"tool_choice": {"type": "function", "function": {"name": "add"}}}
    assert [(n, a) for _, n, a in stream(tok, text, named)[1]] == [("add", '{"a": 1}')]
    assert MistralToolParser(tok).extract_tool_calls(text, AUTO).tools_called is False


def _setup(mode: str, named: str | None = None) -> ToolSetup:
    return ToolSetup(mode=mode, tools={"get_weather": WEATHER, "add": ADD}, named=named, parser="mistral")


def test_forced_calls_schema_is_vllms_pre_v11_array() -> None:
    so = tool_structured_outputs(_setup("required"), None)
    assert so.json == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                          "arguments": fn["parameters"]}, "required": ["name", "arguments"]}
        for fn in (WEATHER, ADD)]}}
    named = tool_structured_outputs(_setup("named", "add"), StructuredOutputsParams(json_object=True))
    assert named.json["maxItems"] == 1 and [s["properties"]["name"]["enum"] for s in named.json["items"]["anyOf"]
                                            ] == [["add"]]
    regex = StructuredOutputsParams(regex="a+")
    assert tool_structured_outputs(_setup("required"), regex) is regex  # the request's own constraint stays
    assert tool_structured_outputs(_setup("auto"), None) is None  # auto is free


def test_start_up_check(pre_v11_tok) -> None:
    check_tokenizer("mistral", pre_v11_tok, "m")
    with pytest.raises(ToolParserTokenizerError, match="Mistral parser could not locate the tool call token"):
        check_tokenizer("mistral", local_tokenizer(), "m")
