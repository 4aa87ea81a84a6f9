"""Tool-call parsers by `--tool-call-parser` name (vLLM's ToolParserManager, the names it registers).

Only formats implemented here are offered; vLLM's other names are refused at start-up with vLLM's
message rather than accepted and ignored. A parser whose format needs a special token (llama3_json:
`<|python_tag|>`, mistral: `[TOOL_CALLS]`) is checked against the tokenizer at start-up, as vLLM's
ParserManager.validate_parser_tokenizer does: `check_tokenizer` below.
"""

from __future__ import annotations

from typing import Any

from tokenloom.server.tool_parsers.base import ExtractedToolCalls, ToolParser, make_call, make_tool_call_id
from tokenloom.server.tool_parsers.hermes import HermesToolParser
from tokenloom.server.tool_parsers.llama import Llama3JsonToolParser
from tokenloom.server.tool_parsers.mistral import MistralToolParser
from tokenloom.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    # vLLM aliases Qwen 2.5 / QwQ / Qwen 3 JSON tool calls to the Hermes parser.
    "qwen3_json": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's alias
    "pythonic": PythonicToolParser,
    "mistral": MistralToolParser,  # known, refused at start-up (see mistral.py)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"invalid tool call parser: {name} (chose from {{ {','.join(TOOL_PARSERS)} }})") from None


class ToolParserTokenizerError(ValueError):
    """The tokenizer lacks what the chosen parser needs (the server does not start)."""


def check_tokenizer(name: str, tokenizer: Any, model_name: str) -> None:
    """vLLM's start-up check, its message word for word."""
    try:
        get_tool_parser(name).check_vocab(tokenizer.get_vocab())
    except RuntimeError as exc:
        raise ToolParserTokenizerError(f"--tool-call-parser {name} cannot be used with the tokenizer of "
                                       f"{model_name!r}: {exc}") from None


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "PythonicToolParser", "ToolParser", "ToolParserTokenizerError",
           "check_tokenizer", "get_tool_parser", "make_call", "make_tool_call_id"]
