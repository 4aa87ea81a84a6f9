"""vLLM's Responses names, as its unit tests import them, mapped onto tokenloom (plumbing only).

tokenloom's Responses code (tokenloom/server/responses_input.py, responses_tools.py, responses_output.py and
serving_responses.py) takes a request's items, tools and text config as the JSON a client sends; vLLM's tests
build some of them as the openai package's pydantic objects (ResponseReasoningItem, ResponseOutputMessage,
CustomTool, ResponseTextConfig, ...) and vLLM's StructuredOutputsParams. Here each such object is handed over as
its JSON (`as_json`: the openai object's `model_dump(by_alias=True, exclude_none=True)`, the params' set fields),
exactly what the server would receive, and each function runs tokenloom's own code:

- the conversation building (`construct_input_messages`, `construct_chat_messages_with_tool_call`,
  `_construct_message_from_response_item`, `should_continue_final_message`) is tokenloom's of the same names;
- `build_response_output_items` is tokenloom's (its JSON items read back as the openai types the test checks);
  vLLM's `FunctionCall` (a parser's call) is tokenloom's, passed on as the chat tool call JSON tokenloom's
  parsers give;
- `ResponsesRequest` is tokenloom's request model; `to_sampling_params(default_max_tokens)` runs the server's
  own path (serving_responses.chat_body → the chat request → requested_structured_outputs →
  responses_sampling_params) on a prompt of 0 tokens and a context of `default_max_tokens`, which is what vLLM's
  argument means (the room the prompt leaves);
- `VLLMValidationError` is tokenloom's APIError (a 400 in vLLM's words; `.parameter` is its field);
- the streamed events: `split_delta` is tokenloom's, on tokenloom's DeltaMessage (vLLM's fields); vLLM's
  `SimpleStreamingEventProcessor` stands in front of tokenloom's ItemStream (see its docstring).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from openai.types.responses import (  # noqa: F401  (re-exported)
    ResponseOutputItem,
    ResponseStreamEvent,
    ResponseTextConfig,
)
from pydantic import BaseModel, TypeAdapter, model_validator

from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.server import responses_input
from tokenloom.server.body import parse_model
from tokenloom.server.errors import APIError as VLLMValidationError  # noqa: F401  (a 400 in vLLM's words)
from tokenloom.server.protocol import ChatCompletionRequest
from tokenloom.server.protocol import ResponsesRequest as _TokenloomResponsesRequest
from tokenloom.server.responses_events import ItemStream, split_delta  # noqa: F401  (re-exported)
from tokenloom.server.responses_output import build_response_output_items as _build_items
from tokenloom.server.responses_tools import (  # noqa: F401  (re-exported under vLLM's names)
    ToolNames,
    decode_custom_tool_input,
    decode_custom_tool_input_prefix,
)
from tokenloom.server.serving_responses import chat_body, responses_sampling_params
from tokenloom.server.structured import requested_structured_outputs
from tokenloom.server.tool_parsers import (  # noqa: F401  (vLLM's generate protocol names)
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
)

# What the mapping's checks of token ids compare against: any id the tests use is in it.
_VOCAB_SIZE = 1 << 31
_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def as_json(value: Any) -> Any:
    """An openai object or a StructuredOutputsParams as the JSON a client sends for it; JSON stays as it is."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, StructuredOutputsParams):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                if getattr(value, f.name) != f.default}
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    return value


class ResponsesRequest(_TokenloomResponsesRequest):
    """tokenloom's Responses request; openai objects given to it are taken as their JSON."""

    @model_validator(mode="before")
    @classmethod
    def _objects_as_json(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: as_json(v) for k, v in data.items()}
        return data

    def to_sampling_params(self, default_max_tokens: int, default_sampling_params: dict | None = None,
                           ) -> SamplingParams:
        """The server's mapping (serving_responses.create_response without the rendering, and without compiling
        a grammar, which vLLM too does later, when the request is added)."""
        body = chat_body(self, {}, [{"role": "user", "content": "test input"}])
        chat = parse_model(ChatCompletionRequest, body)
        return responses_sampling_params(self, chat, 0, default_max_tokens, _VOCAB_SIZE, _MAX_LOGPROBS,
                                         default_sampling_params, requested_structured_outputs(body)[1])


# Conversation building --------------------------------------------------------------------------------
def construct_input_messages(*, request_instructions: str | None = None, request_input: Any,
                             prev_msg: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return responses_input.construct_input_messages(request_instructions=request_instructions,
                                                    request_input=as_json(request_input), prev_msg=prev_msg)


def construct_chat_messages_with_tool_call(items: list[Any]) -> list[dict[str, Any]]:
    return responses_input.construct_chat_messages_with_tool_call(as_json(items))


def _construct_message_from_response_item(item: Any, prev_msg: dict[str, Any] | None = None,
                                          ) -> dict[str, Any] | None:
    return responses_input.message_from_item(as_json(item), prev_msg)


def should_continue_final_message(request_input: Any) -> bool:
    return responses_input.should_continue_final_message(as_json(request_input))


# Output items -------------------------------------------------------------------------------------------
_OUTPUT_ITEM = TypeAdapter(ResponseOutputItem)


def build_response_output_items(reasoning: str | None, content: str | None, tool_calls: list[Any] | None,
                                logprobs: list[Any] | None = None, tools: list[Any] | None = None) -> list[Any]:
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in tool_calls or []]
    items = _build_items(reasoning, content, calls, as_json(logprobs), ToolNames.of(as_json(tools)))
    return [_OUTPUT_ITEM.validate_python(item) for item in items]


# Streaming events -----------------------------------------------------------------------------------------
class _StateType(enum.Enum):
    """vLLM's names for what the open output item is."""

    NONE = "none"
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


_STATE_OF_ITEM = {"message": _StateType.CONTENT, "reasoning": _StateType.REASONING,
                  "function_call": _StateType.TOOL_CALL, "custom_tool_call": _StateType.TOOL_CALL}
_STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@dataclasses.dataclass
class _State:
    current_state: _StateType


class SimpleStreamingEventProcessor:
    """vLLM's processor interface over tokenloom's ItemStream (tokenloom/server/responses_events.py), which
    decides itself when a piece opens a new item: `needs_transition` is never true and `open` adds nothing, so
    every piece goes to ItemStream.feed, as serving_responses feeds it. Its JSON events come back as the openai
    SDK's event types (with vLLM's sequence_number -1 for an event not yet numbered)."""

    def __init__(self, state: Any = None, tools: list[Any] | None = None) -> None:
        self._items = ItemStream(ToolNames.of(as_json(tools)))

    @property
    def state(self) -> _State:
        open_item = self._items.open
        return _State(_StateType.NONE if open_item is None else _STATE_OF_ITEM[open_item.kind])

    def resolve_target_state(self, delta_message: DeltaMessage) -> tuple[_StateType, Any]:
        """Only whether the piece carries anything: which item it belongs to is ItemStream's decision."""
        has_call = bool(delta_message.tool_calls) and delta_message.tool_calls[0].function is not None
        carries = has_call or delta_message.reasoning is not None or bool(delta_message.content)
        return (_StateType.CONTENT if carries else _StateType.NONE), None

    def needs_transition(self, target_state: _StateType, tool_call: Any) -> bool:
        return False

    def open(self, target_state: _StateType, tool_call: Any = None) -> list[Any]:
        return []

    def emit_delta(self, delta_message: DeltaMessage, output: Any, get_logprobs: Any = None) -> list[Any]:
        return _typed(self._items.feed(delta_message))

    def close_current(self) -> list[Any]:
        return _typed(self._items.close())


def _typed(events: list[dict[str, Any]]) -> list[Any]:
    return [_STREAM_EVENT.validate_python({**event, "sequence_number": -1}) for event in events]


def _harmony_only(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("Harmony's streaming (gpt-oss models) is not in tokenloom")


# Harmony's streaming helpers, named in the test's Harmony branch, which is left out of its parameter list.
StreamingState = emit_reasoning_delta_events = emit_reasoning_done_events = _harmony_only
