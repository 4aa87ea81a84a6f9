"""What every tool-call parser shares (vLLM: tool_parsers/abstract_tool_parser.py).

A parser reads a model family's tool-call format out of generated text, whole (`extract_tool_calls`)
or incrementally (`extract_tool_calls_streaming`, called with the text before and after each delta,
returning the delta to send or None). One parser object serves one choice of one request: the
streaming state (what was sent) lives on it. A parser whose format has an xgrammar structural tag
(`structural_tag_model`) is also how tool_choice "required" and a named function are enforced
(vLLM 0.32 with VLLM_ENFORCE_STRICT_TOOL_CALLING, its default): see tokenloom/server/tool_grammar.py.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    # vLLM's make_tool_call_id() ("random" id type): chatcmpl-tool-<uuid4 hex>.
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` is a JSON string (a parsed value is dumped as vLLM does)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


@dataclass
class ExtractedToolCalls:
    """vLLM's ExtractedToolCallInformation."""

    tools_called: bool
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest prefix of `tag` that is a suffix of `text` (vLLM's helper): that much
    of the text is held back while streaming, as it may grow into the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def find_common_prefix(s1: str, s2: str) -> str:
    """vLLM's helper: what two successive renderings of partial JSON agree on (so a closing quote or
    brace that JSON completion added is not streamed before the model wrote it)."""
    n = 0
    for a, b in zip(s1, s2):
        if a != b:
            break
        n += 1
    return s1[:n]


def partial_json_loads(text: str, flags: Any) -> tuple[Any, int]:
    """(value, characters used) of partial JSON; a complete value followed by more text (the next of
    several calls) is decoded alone (vLLM: partial_json_parser does not stop at extra data)."""
    import partial_json_parser

    try:
        return partial_json_parser.loads(text, flags), len(text)
    except json.JSONDecodeError as exc:
        if "Extra data" in exc.msg:
            return json.JSONDecoder().raw_decode(text)
        raise


class ToolParser:
    """Base: the streaming bookkeeping vLLM's parsers share."""

    name = ""
    # The xgrammar structural-tag format of this family (None: required / named use vLLM's JSON forms
    # instead: an array of {"name", "parameters"}, or the named function's arguments; see json_calls.py).
    structural_tag_model: str | None = None
    # Tokens that carry the tool-call markup may be special tokens: keep them in the text.
    keeps_special_tokens = True
    # The system prompt that shows the tools to a chat template that does not render them itself
    # (`{tools}`: one JSON tool per line); it asks for this parser's format.
    tools_prompt = ""

    @classmethod
    def supports_required_and_named(cls) -> bool:
        """vLLM's flag (with VLLM_ENFORCE_STRICT_TOOL_CALLING, its default): a parser with a structural
        tag reads forced calls itself; one without gets the JSON forms."""
        return cls.structural_tag_model is None

    @classmethod
    def check_vocab(cls, vocab: dict[str, int]) -> None:
        """Raise (vLLM's constructor's error) when the tokenizer lacks a token this format needs."""
        return None

    def __init__(self) -> None:
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def get_remaining_unstreamed_args(self) -> str:
        """Arguments parsed but not yet streamed, for the last call (sent with the final delta)."""
        if not self.prev_tool_call_arr:
            return ""
        index = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self.streamed_args_for_tool[index] if index < len(self.streamed_args_for_tool) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""
