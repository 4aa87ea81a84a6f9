"""Tool-call parsers by `--tool-call-parser` name (vLLM's ToolParserManager and the names it registers).

Only formats implemented here are registered; vLLM's other names are refused at start-up with vLLM's
message rather than accepted and ignored. A user's own parsers (written against vLLM's ToolParser,
`base.py`) register through `--tool-parser-plugin`. A parser whose constructor raises for a tokenizer
(llama3_json without `<|python_tag|>`, mistral without `[TOOL_CALLS]`) is refused at start-up, as vLLM's
ParserManager.validate_parser_tokenizer does: `check_tokenizer` below.
"""

from __future__ import annotations

from typing import Any

from tokenloom.server.tool_parsers.base import ToolParser
from tokenloom.server.tool_parsers.manager import ToolParserManager
from tokenloom.server.tool_parsers.messages import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

_PACKAGE = "tokenloom.server.tool_parsers"
# name -> (module, class), vLLM's names; imported on first use.
_BUILTIN = {
    "hermes": ("hermes", "HermesToolParser"),
    # vLLM aliases Qwen 2.5 / QwQ / Qwen 3 JSON tool calls to the Hermes parser.
    "qwen3_json": ("hermes", "HermesToolParser"),
    "llama3_json": ("llama", "Llama3JsonToolParser"),
    "llama4_json": ("llama", "Llama3JsonToolParser"),  # vLLM's alias
    "pythonic": ("pythonic", "PythonicToolParser"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderToolParser"),
    "qwen3_xml": ("qwen3_coder", "Qwen3CoderToolParser"),  # vLLM's alias
    "phi4_mini_json": ("phi4mini", "Phi4MiniJsonToolParser"),
    "mistral": ("mistral", "MistralToolParser"),  # Hugging Face tokenizers (see mistral.py)
}
for _name, (_module, _cls) in _BUILTIN.items():
    ToolParserManager.register_lazy_module(_name, f"{_PACKAGE}.{_module}", _cls)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of a `--tool-call-parser` name; KeyError in vLLM's start-up words."""
    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        choices = ",".join(ToolParserManager.list_registered())
        raise KeyError(f"invalid tool call parser: {name} (chose from {{ {choices} }})") from None


class ToolParserTokenizerError(ValueError):
    """The tokenizer lacks what the chosen parser needs (the server does not start)."""


def check_tokenizer(name: str, tokenizer: Any, model_name: str) -> None:
    """vLLM's start-up check (a parser built for this tokenizer), its message word for word."""
    try:
        get_tool_parser(name)(tokenizer)
    except Exception as exc:
        raise ToolParserTokenizerError(f"--tool-call-parser {name} cannot be used with the tokenizer of "
                                       f"{model_name!r}: {exc}") from None


__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation", "FunctionCall",
           "ToolCall", "ToolParser", "ToolParserManager", "ToolParserTokenizerError", "check_tokenizer",
           "get_tool_parser", "make_tool_call_id"]
