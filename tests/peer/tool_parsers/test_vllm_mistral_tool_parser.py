# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/parser/mistral/test_tool_calls.py: its pre-v11 whole-output cases (the
# Hugging Face tokenizer path), unchanged but for the imports (tests/peer/tool_parsers/vllm_shim.py; ToolCall /
# FunctionCall are tokenloom's, vLLM's tests take mistral-common's, whose fields they read the same way) and
# the tokenizer, a local equivalent of mistralai/Mistral-7B-Instruct-v0.3's (no Hub here): the default model's
# SmolLM2 tokenizer with [TOOL_CALLS] added as a special token (vllm_shim.get_tokenizer). The v11 parameter
# of test_extract_tool_calls_no_tools and the other tests need mistral-common's tokenizer, vLLM's parser
# engine internals or ijson: docs/vllm_peer.md, "Tool parsers", lists them and why.

import json

import partial_json_parser
import pytest
from partial_json_parser.core.options import Allow

from tests.peer.tool_parsers.vllm_shim import (
    ChatCompletionRequest,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    MistralToolParser,
    ToolCall,
    get_tokenizer,
)

_DUMMY_REQUEST = ChatCompletionRequest(messages=[], model="test")


@pytest.fixture(scope="module")
def mistral_pre_v11_tokenizer():
    MODEL = "mistralai/Mistral-7B-Instruct-v0.3"
    return get_tokenizer(tokenizer_name=MODEL)


@pytest.fixture
def mistral_pre_v11_tool_parser(mistral_pre_v11_tokenizer):
    return MistralToolParser(mistral_pre_v11_tokenizer)


def assert_tool_calls(
    actual_tool_calls: list[ToolCall] | list[DeltaToolCall],
    expected_tool_calls: list[ToolCall],
):
    assert len(actual_tool_calls) == len(expected_tool_calls)

    for actual_tool_call, expected_tool_call in zip(
        actual_tool_calls, expected_tool_calls
    ):
        assert isinstance(actual_tool_call.id, str)
        assert len(actual_tool_call.id) == 9

        if isinstance(actual_tool_call, ToolCall):
            assert actual_tool_call.type == "function"
        elif isinstance(actual_tool_call, DeltaToolCall):
            assert actual_tool_call.function is not None
            assert actual_tool_call.function.name is not None
            assert actual_tool_call.function.arguments is not None
        assert actual_tool_call.function is not None
        assert actual_tool_call.function.name == expected_tool_call.function.name, (
            f"got wrong function name:${actual_tool_call.function.name}"
        )
        actual_args = actual_tool_call.function.arguments
        # Streaming deltas (DeltaToolCall) may have partial JSON because the
        # engine holds back the final closing brace until finish() is called.
        # Apply partial_json_parser so the comparison works for both the
        # legacy (complete JSON) and engine (potentially partial) paths.
        if isinstance(actual_tool_call, DeltaToolCall) and actual_args is not None:
            actual_args = partial_json_parser.ensure_json(
                actual_args, Allow.OBJ | Allow.STR
            )
        assert actual_args == expected_tool_call.function.arguments, (
            f"got wrong function argument:${actual_tool_call.function.arguments}"
        )



@pytest.mark.parametrize(
    "parser_fixture",
    ["mistral_pre_v11_tool_parser"],
    ids=["pre_v11"],
)
def test_extract_tool_calls_no_tools(parser_fixture, request):
    parser = request.getfixturevalue(parser_fixture)
    model_output = "This is a test"
    result = parser.extract_tool_calls(model_output, request=_DUMMY_REQUEST)
    assert result == ExtractedToolCallInformation(
        tools_called=False, tool_calls=[], content=model_output
    )



@pytest.mark.parametrize(
    ids=[
        "single_tool_add",
        "single_tool_weather",
        "argument_before_name",
        "argument_before_name_and_name_in_argument",
        "multiple_tools",
        "content_before_tool",
        "trailing_data_after_json",
    ],
    argnames=["model_output", "expected_tool_calls", "expected_content"],
    argvalues=[
        (
            """[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="add", arguments=json.dumps({"a": 3.5, "b": 4})
                    )
                )
            ],
            None,
        ),
        (
            """[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="get_current_weather",
                        arguments=json.dumps(
                            {"city": "San Francisco", "state": "CA", "unit": "celsius"}
                        ),
                    )
                )
            ],
            None,
        ),
        (
            """[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": "get_current_weather"}]""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="get_current_weather",
                        arguments=json.dumps(
                            {"city": "San Francisco", "state": "CA", "unit": "celsius"}
                        ),
                    )
                )
            ],
            None,
        ),
        (
            """[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="get_age",
                        arguments=json.dumps(
                            {
                                "name": "John Doe",
                            }
                        ),
                    )
                )
            ],
            None,
        ),
        (
            """[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="add", arguments=json.dumps({"a": 3.5, "b": 4})
                    )
                ),
                ToolCall(
                    function=FunctionCall(
                        name="get_current_weather",
                        arguments=json.dumps(
                            {"city": "San Francisco", "state": "CA", "unit": "celsius"}
                        ),
                    )
                ),
            ],
            None,
        ),
        (
            """Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="add", arguments=json.dumps({"a": 1, "b": 2})
                    )
                )
            ],
            "Hello",
        ),
        (
            """[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}]\nextra trailing data""",  # noqa: E501
            [
                ToolCall(
                    function=FunctionCall(
                        name="get_current_weather",
                        arguments=json.dumps(
                            {
                                "city": "Dallas",
                                "state": "TX",
                                "unit": "fahrenheit",
                            }
                        ),
                    )
                )
            ],
            None,
        ),
    ],
)
def test_extract_tool_calls_pre_v11_tokenizer(
    mistral_pre_v11_tool_parser, model_output, expected_tool_calls, expected_content
):
    extracted_tool_calls = mistral_pre_v11_tool_parser.extract_tool_calls(
        model_output, request=_DUMMY_REQUEST
    )
    assert extracted_tool_calls.tools_called

    assert_tool_calls(extracted_tool_calls.tool_calls, expected_tool_calls)

    assert extracted_tool_calls.content == expected_content


def test_extract_tool_calls_pre_v11_multiple_bot_tokens(
    mistral_pre_v11_tool_parser,
):
    """A second BOT token must not fail the request; like streaming, only the
    calls after the first BOT token are extracted."""
    model_output = (
        '[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1}}]'
        '[TOOL_CALLS] [{"name": "sub", "arguments":{"b": 2}}]'
    )
    result = mistral_pre_v11_tool_parser.extract_tool_calls(
        model_output, request=_DUMMY_REQUEST
    )
    assert result.tools_called
    assert [(tc.function.name, tc.function.arguments) for tc in result.tool_calls] == [
        ("add", '{"a": 1}')
    ]


def test_extract_tool_calls_pre_v11_regex_fallback(
    mistral_pre_v11_tool_parser,
):
    """The regex fallback path finds valid JSON via regex when the primary
    raw_decode fails on leading junk. It should re-serialize arguments
    and return a valid tool call."""
    model_output = (
        '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail'
    )
    result = mistral_pre_v11_tool_parser.extract_tool_calls(
        model_output, request=_DUMMY_REQUEST
    )
    assert result.tools_called
    assert len(result.tool_calls) == 1
    assert result.tool_calls[0].function.name == "add"
    assert result.tool_calls[0].function.arguments == json.dumps({"a": 1, "b": 2})


@pytest.mark.parametrize(
    "stringified_tool_calls",
    ["not json at all", "42", '["add"]', '{"foo": 1}'],
    ids=["invalid_json", "scalar", "list_of_str", "not_a_call"],
)
def test_extract_tool_calls_pre_v11_no_tool_call_returns_content(
    mistral_pre_v11_tool_parser, stringified_tool_calls
):
    """Output that holds no tool call is returned as content instead of failing
    the request."""
    result = mistral_pre_v11_tool_parser.extract_tool_calls(
        f"[TOOL_CALLS] {stringified_tool_calls}", request=_DUMMY_REQUEST
    )
    assert result == ExtractedToolCallInformation(
        tools_called=False, tool_calls=[], content=stringified_tool_calls
    )


# (model_output, expected (name, arguments), streamed content). Non-streaming
# drops the text after the calls; streaming returns it as content.
_PRE_V11_UNUSUAL_CALLS = [
    pytest.param(
        '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}',
        [("add", '{"a": 1}')],
        "",
        id="bare_object",
    ),
    # The next three end the bare object and start the trailing text in the
    # same token, in each state the object can close from.
    pytest.param(
        '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}, '
        '{"name": "sub", "arguments": {"b": 2}}',
        [("add", '{"a": 1}')],
        ', {"name": "sub", "arguments": {"b": 2}}',
        id="bare_object_then_text",
    ),
    pytest.param(
        '[TOOL_CALLS] {"arguments": {"a": 1}, "name": "add"}, '
        '{"name": "sub", "arguments": {"b": 2}}',
        [("add", '{"a": 1}')],
        ', {"name": "sub", "arguments": {"b": 2}}',
        id="bare_object_name_last_then_text",
    ),
    pytest.param(
        '[TOOL_CALLS] {"name": "add", "arguments": "{\\"a\\": 1}"}, '
        '{"name": "sub", "arguments": {"b": 2}}',
        [("add", '{"a": 1}')],
        ', {"name": "sub", "arguments": {"b": 2}}',
        id="bare_object_string_arguments_then_text",
    ),
    pytest.param(
        '[TOOL_CALLS] [{"arguments": {"a": 1}}]',
        [("", '{"a": 1}')],
        "",
        id="missing_name",
    ),
    pytest.param(
        '[TOOL_CALLS] [{"name": "add", "arguments": "{\\"a\\": 1}"}, '
        '{"name": "sub", "arguments": {"b": 2}}]',
        [("add", '{"a": 1}'), ("sub", '{"b": 2}')],
        "",
        id="string_arguments",
    ),
    pytest.param(
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, "junk"]',
        [("add", '{"a": 1}')],
        "",
        id="entry_not_a_call",
    ),
    # Mistral-7B-Instruct-v0.3 emits repeated BOT tokens at temperature 0.
    pytest.param(
        '[TOOL_CALLS] [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]',
        [("add", '{"a": 1}')],
        "",
        id="consecutive_bot_tokens",
    ),
    pytest.param(
        '[TOOL_CALLS] [TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}',
        [("add", '{"a": 1}')],
        "",
        id="consecutive_bot_tokens_bare_object",
    ),
]


@pytest.mark.parametrize("model_output,expected,_", _PRE_V11_UNUSUAL_CALLS)
def test_extract_tool_calls_pre_v11_unusual_calls(
    mistral_pre_v11_tool_parser, model_output, expected, _
):
    result = mistral_pre_v11_tool_parser.extract_tool_calls(
        model_output, request=_DUMMY_REQUEST
    )
    assert result.tools_called
    assert [
        (tc.function.name, tc.function.arguments) for tc in result.tool_calls
    ] == expected
    assert result.content is None

