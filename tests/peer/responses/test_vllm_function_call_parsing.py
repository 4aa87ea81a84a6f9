# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/entrypoints/openai/responses/test_function_call_parsing.py. Plumbing changed,
# test bodies as they are: ResponsesRequest is tokenloom's request model (tests/peer/responses/vllm_shim.py).
# tokenloom keeps a request's input items as the JSON the client sent (its server does not depend on the openai
# package, whose types vLLM converts them to) and reads them when it builds the conversation
# (tokenloom/server/responses_input.py, by vLLM's rules: tests/peer/responses/test_vllm_responses_utils.py); the
# cases that check that conversion are xfail(strict) with that reason. Not vendored:
# test_function_call_validation_failure_logs_debug (it patches vLLM's module logger to see the debug line of that
# conversion's fallback, which tokenloom does not have).
"""Test function call parsing in ResponsesRequest."""

import json

import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

from tests.peer.responses.vllm_shim import ResponsesRequest

# Why the xfail(strict) cases fail here (docs/vllm_peer.md, "Responses unit level").
JSON_ITEMS = ("tokenloom keeps input items as the JSON sent (its server has no openai dependency) and reads them "
              "when it builds the conversation; vLLM converts them to the openai types this checks")
SAME_OBJECT = "tokenloom takes an item as its JSON (the shim hands it over so): it is not the same object"
CHECKED_LATER = ("tokenloom checks items when it builds the conversation: a call without call_id is a 400 naming "
                 "input.0 before anything runs, not an error when the request model is made")
STRICT_LIST = ("tokenloom's request model is strict: input is a JSON list (an iterator never comes from a request "
               "body)")


@pytest.mark.xfail(strict=True, reason=JSON_ITEMS)
def test_function_call_dict_converted_to_object():
    """Test that function_call dictionaries are correctly parsed into
    ResponseFunctionToolCall objects."""
    # Create a request with function_call as dict
    request_data = {
        "model": "gpt-oss",
        "input": [
            {
                "type": "function_call",
                "call_id": "fc_123",
                "name": "get_weather",
                "arguments": '{"location": "Boston", "unit": "celsius"}',
            }
        ],
    }

    request = ResponsesRequest(**request_data)

    # Verify the input item is now a ResponseFunctionToolCall object
    assert len(request.input) == 1
    assert isinstance(request.input[0], ResponseFunctionToolCall)
    assert request.input[0].call_id == "fc_123"
    assert request.input[0].name == "get_weather"
    assert request.input[0].arguments == '{"location": "Boston", "unit": "celsius"}'


@pytest.mark.xfail(strict=True, reason=SAME_OBJECT)
def test_direct_function_call_object_preservation():
    """Test that ResponseFunctionToolCall objects passed directly are preserved."""
    # Create a request with ResponseFunctionToolCall object
    function_call = ResponseFunctionToolCall(
        type="function_call",
        call_id="fc_456",
        name="get_stock_price",
        arguments='{"symbol": "AAPL"}',
    )

    request_data = {"model": "gpt-oss", "input": [function_call]}

    request = ResponsesRequest(**request_data)

    # Verify the object is preserved
    assert len(request.input) == 1
    assert request.input[0] is function_call


@pytest.mark.xfail(strict=True, reason=JSON_ITEMS)
def test_mixed_input_types_with_function_calls():
    """Test parsing with mixed input types including function calls."""
    request_data = {
        "model": "gpt-oss",
        "input": [
            # Valid Message type
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What's the weather?"}],
            },
            # Function call that should be parsed
            {
                "type": "function_call",
                "call_id": "fc_789",
                "name": "check_weather",
                "arguments": '{"location": "NYC"}',
            },
            # Another function call
            {
                "type": "function_call",
                "call_id": "fc_790",
                "name": "get_time",
                "arguments": "{}",
            },
        ],
    }

    request = ResponsesRequest(**request_data)

    # Verify mixed types are handled correctly
    assert len(request.input) == 3
    # First item should be validated as Message
    assert request.input[0]["type"] == "message"
    # Second item should be parsed to ResponseFunctionToolCall
    assert isinstance(request.input[1], ResponseFunctionToolCall)
    assert request.input[1].call_id == "fc_789"
    assert request.input[1].name == "check_weather"
    # Third item should also be parsed to ResponseFunctionToolCall
    assert isinstance(request.input[2], ResponseFunctionToolCall)
    assert request.input[2].call_id == "fc_790"
    assert request.input[2].name == "get_time"


@pytest.mark.xfail(strict=True, reason=JSON_ITEMS)
def test_function_call_with_complex_arguments():
    """Test parsing function calls with complex nested arguments."""
    complex_args = {
        "query": "weather forecast",
        "filters": {
            "location": {"city": "San Francisco", "state": "CA"},
            "timeRange": {"start": "2024-01-01", "end": "2024-01-07"},
            "metrics": ["temperature", "humidity", "precipitation"],
        },
        "options": {"format": "detailed", "includeAlerts": True},
    }

    request_data = {
        "model": "gpt-oss",
        "input": [
            {
                "type": "function_call",
                "call_id": "fc_complex",
                "name": "advanced_weather_query",
                "arguments": json.dumps(complex_args),
            }
        ],
    }

    request = ResponsesRequest(**request_data)

    # Verify complex arguments are preserved correctly
    assert len(request.input) == 1
    assert isinstance(request.input[0], ResponseFunctionToolCall)
    assert request.input[0].call_id == "fc_complex"
    assert request.input[0].name == "advanced_weather_query"

    # Parse the arguments back to verify they're intact
    parsed_args = json.loads(request.input[0].arguments)
    assert parsed_args == complex_args


@pytest.mark.xfail(strict=True, reason=CHECKED_LATER)
def test_invalid_function_call_fallback():
    """Test that invalid function call dictionaries fall back gracefully."""
    # Missing required field 'call_id'
    request_data = {
        "model": "gpt-oss",
        "input": [
            {"type": "function_call", "name": "incomplete_function", "arguments": "{}"}
        ],
    }

    # This should not raise an error during model creation
    # The validator should keep the original dict and let Pydantic
    # handle validation
    with pytest.raises(ValueError):
        # Pydantic should raise a validation error for the invalid structure
        ResponsesRequest(**request_data)


def test_string_input_not_affected():
    """Test that string input is not affected by the validator."""
    request_data = {"model": "gpt-oss", "input": "This is a simple string input"}

    request = ResponsesRequest(**request_data)

    # Verify string input remains unchanged
    assert request.input == "This is a simple string input"


def test_empty_list_input():
    """Test that empty list input is handled correctly."""
    request_data = {"model": "gpt-oss", "input": []}

    request = ResponsesRequest(**request_data)

    # Verify empty list is preserved
    assert request.input == []


def test_function_call_output_not_affected():
    """Test that FunctionCallOutput is not affected by the function_call parsing."""
    # Test with FunctionCallOutput as dict (should not be parsed)
    request_data = {
        "model": "gpt-oss",
        "input": [
            {
                "type": "function_call_output",
                "call_id": "fc_output_123",
                "output": "The weather in Boston is 72°F and sunny.",
            }
        ],
    }

    request = ResponsesRequest(**request_data)

    # FunctionCallOutput should remain as dict (not converted to an object)
    assert len(request.input) == 1
    assert isinstance(request.input[0], dict)
    assert request.input[0]["type"] == "function_call_output"
    assert request.input[0]["call_id"] == "fc_output_123"
    assert request.input[0]["output"] == "The weather in Boston is 72°F and sunny."


@pytest.mark.xfail(strict=True, reason=JSON_ITEMS)
def test_mixed_function_call_and_output():
    """Test that function_call is parsed while function_call_output is preserved."""
    request_data = {
        "model": "gpt-oss",
        "input": [
            # This should be parsed to ResponseFunctionToolCall
            {
                "type": "function_call",
                "call_id": "fc_call_456",
                "name": "get_weather",
                "arguments": '{"location": "NYC"}',
            },
            # This should remain as dict
            {
                "type": "function_call_output",
                "call_id": "fc_call_456",
                "output": "NYC weather is 68°F with light rain",
            },
        ],
    }

    request = ResponsesRequest(**request_data)

    assert len(request.input) == 2

    # First item should be parsed to ResponseFunctionToolCall
    assert isinstance(request.input[0], ResponseFunctionToolCall)
    assert request.input[0].call_id == "fc_call_456"
    assert request.input[0].name == "get_weather"

    # Second item should remain as dict (FunctionCallOutput)
    assert isinstance(request.input[1], dict)
    assert request.input[1]["type"] == "function_call_output"
    assert request.input[1]["call_id"] == "fc_call_456"
    assert request.input[1]["output"] == "NYC weather is 68°F with light rain"


@pytest.mark.xfail(strict=True, reason=STRICT_LIST)
def test_validator_handles_iterator_input():
    """Test that validator can handle ValidatorIterator input (Pydantic internal)."""
    # This test simulates when Pydantic passes a ValidatorIterator instead of a list
    # This happened with complex nested structures containing reasoning + function_call

    # Create test data that would normally be a list
    test_input_items = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Test"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Test reasoning"}],
            "content": [{"type": "reasoning_text", "text": "Test content"}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "test_function",
            "arguments": '{"test": "value"}',
            "id": "fc_1",
        },
    ]

    # Mock data where input is an iterator (simulates Pydantic ValidatorIterator)
    mock_data = {
        "model": "test-model",
        "input": iter(test_input_items),  # Iterator instead of list
    }

    # This should NOT raise an error with the fixed validator
    try:
        request = ResponsesRequest(**mock_data)

        # Verify the validator processed the data correctly
        assert len(request.input) == 3

        # Verify function_call was converted to ResponseFunctionToolCall object
        function_call_item = None
        for item in request.input:
            if isinstance(item, ResponseFunctionToolCall):
                function_call_item = item
                break

        assert function_call_item is not None
        assert function_call_item.call_id == "call_1"
        assert function_call_item.name == "test_function"

    except Exception as e:
        pytest.fail(f"Validator should handle iterator input, but failed with: {e}")


@pytest.mark.xfail(strict=True, reason=STRICT_LIST)
def test_validator_handles_empty_iterator():
    """Test validator handles empty iterator gracefully."""
    mock_data = {
        "model": "test-model",
        "input": iter([]),  # Empty iterator
    }

    request = ResponsesRequest(**mock_data)
    assert request.input == []


def test_assistant_string_content_stays_easyinput():
    """EasyInput assistant message with plain string content is not
    coerced into a ResponseOutputMessage."""
    request_data = {
        "model": "test-model",
        "input": [
            {"type": "message", "role": "assistant", "content": "hello"},
        ],
    }

    request = ResponsesRequest(**request_data)

    item = request.input[0]
    assert isinstance(item, dict), (
        "String-content assistant message should remain a dict (EasyInput), "
        f"got {type(item)}"
    )
    assert item.get("content") == "hello"
    assert "id" not in item
    assert "status" not in item


@pytest.mark.xfail(strict=True, reason=JSON_ITEMS)
def test_assistant_output_style_content_coerced():
    """Assistant message whose content is output-message-shaped (list of
    output_text items) should be coerced to ResponseOutputMessage."""
    request_data = {
        "model": "test-model",
        "input": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "world"}],
            },
        ],
    }

    request = ResponsesRequest(**request_data)

    item = request.input[0]
    assert isinstance(item, ResponseOutputMessage), (
        "Output-style assistant message should be coerced to "
        f"ResponseOutputMessage, got {type(item)}"
    )
    assert item.content[0].text == "world"
    assert item.content[0].annotations == []
    assert item.status == "completed"
    assert item.id.startswith("msg_")
