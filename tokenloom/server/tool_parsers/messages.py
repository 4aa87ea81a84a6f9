"""What a tool parser returns, by vLLM's names and shapes (vLLM: entrypoints/generate/base/protocol.py), so a
parser written for vLLM (`--tool-parser-plugin`) returns the same objects here.

Whole output: `ExtractedToolCallInformation` (tools_called, tool_calls: [ToolCall], content).
Streaming: one `DeltaMessage` per delta (content and/or tool_calls: [DeltaToolCall]), or None for nothing
to send yet. The server turns either into its JSON with `delta_dict` / `call_dict`.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# OpenAI's objects allow fields they do not name (vLLM's OpenAIBaseModel).
_OPEN = ConfigDict(extra="allow")


def make_tool_call_id() -> str:
    # vLLM's make_tool_call_id() ("random" id type): chatcmpl-tool-<uuid4 hex>.
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    model_config = _OPEN
    # A parser's own id for the call, kept out of the serialised object (vLLM's field).
    id: str | None = Field(default=None, exclude=True)
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    model_config = _OPEN
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of one call while streaming: id, type and name on its first piece, arguments text after."""

    model_config = _OPEN
    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class ExtractedToolCallInformation(BaseModel):
    tools_called: bool
    tool_calls: list[ToolCall]
    # Text besides the calls (OpenAI allows content and calls together; some models write both).
    content: str | None = None


class DeltaMessage(BaseModel):
    model_config = _OPEN
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


def call_dict(call: ToolCall) -> dict[str, Any]:
    """A whole call as the response's message carries it."""
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": call.function.arguments}}


def delta_dict(message: DeltaMessage) -> dict[str, Any]:
    """A streamed delta as the chunk carries it: content (None when the delta is only calls) and each call
    piece with only the fields it has."""
    return {"content": message.content,
            "tool_calls": [tc.model_dump(exclude_none=True) for tc in message.tool_calls]}
