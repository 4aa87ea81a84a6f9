"""What every tool-call parser shares: vLLM's ToolParser interface (vLLM: tool_parsers/abstract_tool_parser.py),
so a parser written for vLLM runs here unchanged (`--tool-parser-plugin`), and the helpers its parsers use.

A parser is built per request choice with the tokenizer and the request's tools, `Parser(tokenizer, tools)`.
It reads a model family's tool-call format out of generated text, whole (`extract_tool_calls(model_output,
request)` → ExtractedToolCallInformation) or incrementally (`extract_tool_calls_streaming(previous_text,
current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids, request)` → the
DeltaMessage to send, or None); the streaming state (what was sent) lives on it. A constructor that raises
refuses the parser for that tokenizer at start-up (vLLM's check; `check_tokenizer` in __init__.py).

A parser whose format has an xgrammar structural tag (`structural_tag_model`) reads forced calls
(tool_choice "required" / a named function) itself (vLLM 0.32 with VLLM_ENFORCE_STRICT_TOOL_CALLING, its
default): see tokenloom/server/tool_grammar.py. The others get vLLM's JSON forms (json_calls.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from tokenloom.server.tool_parsers.messages import DeltaMessage, ExtractedToolCallInformation


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


def tool_function(tool: Any) -> dict[str, Any] | None:
    """A request tool's function definition ({"name", "parameters", ...}), whatever shape it came in: chat's
    {"type": "function", "function": {...}}, Responses' flat function tool, or either as a pydantic object
    (vLLM's ChatCompletionToolsParam, openai's FunctionTool); None for a tool that is not a function."""
    if hasattr(tool, "model_dump"):
        tool = tool.model_dump()
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def find_tool_properties(tools: Sequence[Any] | None, name: str) -> dict[str, Any]:
    """The `properties` of the named tool's parameters schema ({} when there is no such tool or schema)."""
    for tool in tools or ():
        fn = tool_function(tool)
        if fn is not None and fn["name"] == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


class ToolParser:
    """Base: the state vLLM's parsers share, and tokenloom's class-level facts about a format."""

    # vLLM: whether tool_choice "required" / a named function are forced in the JSON forms and read by
    # their rules (json_calls.py) rather than by this parser. A parser with a structural tag reads them itself.
    supports_required_and_named: bool = True
    # The xgrammar structural-tag format of this family (tokenloom/server/tool_grammar.py).
    structural_tag_model: str | None = None
    # Tokens that carry the tool-call markup may be special tokens: keep them in the text (vLLM's
    # adjust_request sets skip_special_tokens=False for such parsers).
    keeps_special_tokens = False
    # The system prompt that shows the tools to a chat template that does not render them itself
    # (`{tools}`: one JSON tool per line); it asks for this parser's format.
    tools_prompt = ""

    @classmethod
    def forced_calls_schema(cls, tools: dict[str, dict[str, Any]], named: str | None) -> dict[str, Any] | None:
        """The JSON schema this parser's own format forces "required" / a named function with (vLLM: the
        parser's adjust_request), None for vLLM's JSON forms or a structural tag instead."""
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.structural_tag_model is not None:
            cls.supports_required_and_named = False

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.current_tool_id = -1  # the call being streamed
        self.current_tool_name_sent = False
        self.streamed_args_for_tool: list[str] = []
        self.model_tokenizer = tokenizer
        self.tools: list[Any] = [t for t in tools or () if tool_function(t) is not None]

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab() if self.model_tokenizer is not None else {}

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
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
