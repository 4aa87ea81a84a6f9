"""What a reasoning parser hands back while streaming: vLLM's DeltaMessage (vllm/entrypoints/generate/base/
protocol.py), the fields a chat chunk's `delta` carries.

A plain dataclass here, not vLLM's pydantic model: the parsers run in the engine process too (the
structured-output gate), which loads no HTTP machinery. `as_delta()` is the chunk's JSON, as vLLM dumps a
DeltaMessage (`exclude_unset`: only the fields a parser set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DeltaMessage:
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def as_delta(self) -> dict[str, Any]:
        """The chunk's `delta`: the fields that carry something, tool calls only when there are some."""
        out: dict[str, Any] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.content is not None:
            out["content"] = self.content
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out
