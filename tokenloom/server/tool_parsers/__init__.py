"""Tool-call parsers by `--tool-call-parser` name (vLLM's ToolParserManager, the names it registers).

Only formats implemented here are offered; vLLM's other names (llama3_json, mistral, ...) are refused
at start-up with vLLM's message rather than accepted and ignored.
"""

from __future__ import annotations

from tokenloom.server.tool_parsers.base import ExtractedToolCalls, ToolParser, make_call, make_tool_call_id
from tokenloom.server.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    # vLLM aliases Qwen 2.5 / QwQ / Qwen 3 JSON tool calls to the Hermes parser.
    "qwen3_json": HermesToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"invalid tool call parser: {name} (chose from {{ {','.join(TOOL_PARSERS)} }})") from None


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "ToolParser", "get_tool_parser",
           "make_call", "make_tool_call_id"]
