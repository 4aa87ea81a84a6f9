"""`--tool-call-parser mistral`: known by name, refused at start-up.

vLLM's Mistral parser needs the `[TOOL_CALLS]` control token: its constructor raises without it, and
vLLM's start-up check turns that into the error (`... cannot be used with the tokenizer of ...`) that
tokenloom gives too. With the token present vLLM reads the calls through mistral-common's grammar and
tokenizer modes, which tokenloom does not implement: it refuses that case too, in its own words, rather
than parse Mistral output with a guess.
"""

from __future__ import annotations

from typing import Any

from tokenloom.server.tool_parsers.base import ToolParser

TOOL_CALLS_TOKEN = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        if self.vocab.get(TOOL_CALLS_TOKEN) is None:
            raise RuntimeError("Mistral parser could not locate the tool call token in the tokenizer!")
        raise RuntimeError("tokenloom does not implement the mistral tool parser (vLLM reads it with "
                           "mistral-common); use hermes, llama3_json, pythonic, qwen3_coder or phi4_mini_json")
