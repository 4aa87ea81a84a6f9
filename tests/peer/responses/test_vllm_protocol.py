# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/entrypoints/openai/responses/test_protocol.py. Plumbing changed, test bodies
# as they are: ResponsesRequest is tokenloom's request model and VLLMValidationError tokenloom's APIError
# (tests/peer/responses/vllm_shim.py). Not vendored: test_serialize_message and test_serialize_messages (Harmony's
# openai_harmony.Message, for gpt-oss models). test_custom_tool_grammar_format_rejected is xfail(strict): its 400
# passes; it then reads the accepted custom tool as an openai object (`request.tools[0].type`), where tokenloom keeps
# tools as the JSON sent (`request.tools[0]["type"] == "custom"`).
import pytest
from pydantic import ValidationError

from tests.peer.responses.vllm_shim import ResponsesRequest, VLLMValidationError


@pytest.mark.xfail(strict=True, reason="tokenloom keeps tools as the JSON sent: the refusal passes, then the accepted "
                   "tool is read as an openai object (request.tools[0].type), a dict here")
def test_custom_tool_grammar_format_rejected() -> None:
    grammar = {"type": "grammar", "syntax": "lark", "definition": 'start: "pwd"'}
    with pytest.raises(VLLMValidationError) as exc_info:
        ResponsesRequest(
            input="hi", tools=[{"type": "custom", "name": "emit", "format": grammar}]
        )
    assert exc_info.value.parameter == "tools"

    request = ResponsesRequest(
        input="hi",
        tools=[{"type": "custom", "name": "emit", "format": {"type": "text"}}],
    )
    assert request.tools is not None and request.tools[0].type == "custom"


@pytest.mark.parametrize(
    "tools",
    [
        "abc",
        {"type": "custom"},
        [None],
        [{"type": "custom", "name": "x", "format": "text"}],
    ],
)
def test_malformed_tools_rejected_by_field_validation(tools) -> None:
    """Malformed tools bodies fail pydantic field validation (4xx), not an
    AttributeError inside the custom-format validator (500)."""
    with pytest.raises(ValidationError):
        ResponsesRequest(input="hi", tools=tools)
