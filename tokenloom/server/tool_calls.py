"""Tool calls in chat responses: the message / deltas a generation becomes, as vLLM's serving_chat.py
builds them (whole: `chat_completion_full_generator`; streamed: the parser's `parse_delta`).

Which calls there are is the tool parser's business (tokenloom/server/tool_parsers/): the same parser
reads "auto" output and the output a structural tag forced under "required" or a named function. A
parser without a structural tag (pythonic) has its forced calls written in vLLM's JSON forms and read by
their rules (tool_parsers/json_calls.py), as vLLM's supports_required_and_named path does.

Without --tool-call-parser, "required" and a named function still work (vLLM's rule): forced in those
JSON forms and read by their rules; only "auto" needs a parser.

Whole response: "required" / named give `content` "" and the calls; "auto" gives the text before the
first call as content (None when only whitespace), or the whole text when no call parsed.
finish_reason: "tool_calls" when "auto" called a tool, or under "required" when the model stopped;
a named function keeps "stop" (OpenAI's rule, vLLM's code).
Streaming: content as generated; each call announced once its name is known (index, id, type, name),
then its arguments in pieces; finish_reason "tool_calls" once any call was streamed (not named).
At the end of a stream a parser that buffers (vLLM's engine-based ones: `finish_streaming`) gives up what
it held, else the last call's parsed but unsent arguments go out (vLLM's finalize).
`parallel_tool_calls: false` keeps only the first call (index 0), as vLLM filters it.

Parsers answer with vLLM's objects (tool_parsers/messages.py); this module turns them into the response's
JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenloom.server.tool_parsers import DeltaFunctionCall, DeltaMessage, ToolParser, get_tool_parser
from tokenloom.server.tool_parsers.json_calls import (
    NamedCallStreamer,
    parse_named,
    parse_required,
    required_call_deltas,
)
from tokenloom.server.tool_parsers.messages import call_dict, delta_dict
from tokenloom.server.tools import ToolSetup


def tools_system_prompt(tools: list[dict[str, Any]], parser: str = "hermes") -> str:
    """The tools shown to a chat template that does not render them (SmolLM2's), in the words of the
    parser's model family, so the model is asked for the format the parser reads."""
    return get_tool_parser(parser).tools_prompt.format(tools="\n".join(json.dumps(t) for t in tools))


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in str(chat_template)


def _parser(tools: ToolSetup) -> ToolParser:
    assert tools.parser is not None
    return get_tool_parser(tools.parser)(tools.tokenizer, tools.tool_list)


def _json_form(tools: ToolSetup) -> bool:
    """Forced calls of a parser without a structural tag, or of a server without a parser: written in
    vLLM's JSON forms, read by their rules (tool_parsers/json_calls.py), not by a parser."""
    if tools.mode not in ("required", "named"):
        return False
    return tools.parser is None or get_tool_parser(tools.parser).supports_required_and_named


def parse_output(text: str, tools: ToolSetup) -> tuple[str | None, list[dict[str, Any]]]:
    """(message content, tool calls) of a whole generation (tools.parses_calls)."""
    if _json_form(tools):
        if tools.mode == "named":
            assert tools.named is not None
            calls = parse_named(text, tools.named)
        else:
            calls = parse_required(text)
        return "", calls[:1] if not tools.parallel_tool_calls else calls
    info = _parser(tools).extract_tool_calls(text, tools.request)
    calls = [call_dict(c) for c in info.tool_calls] if info.tools_called else []
    if not tools.parallel_tool_calls:
        calls = calls[:1]
    content = info.content if info.tools_called else text
    if content is not None and not content.strip() and (info.tools_called or tools.mode != "auto"):
        content = None
    if tools.mode in ("required", "named"):
        return content or "", calls
    return content, calls


def finish_reason(reason: str | None, tools: ToolSetup | None, calls: list[dict[str, Any]]) -> str | None:
    """Of a whole response."""
    if tools is None or not tools.parses_calls or reason is None:
        return reason
    if (tools.mode == "auto" and calls) or (tools.mode == "required" and reason == "stop"):
        return "tool_calls"
    return reason


class StreamingToolParser:
    """One choice's text deltas → chunk deltas ({"content": ..., "tool_calls": [...]}) as they become known."""

    def __init__(self, tools: ToolSetup) -> None:
        self.tools = tools
        self.parser = _parser(tools) if tools.parser is not None else None
        self.json_form = _json_form(tools)
        self.named = NamedCallStreamer(tools.named) if self.json_form and tools.named else None
        self.text = ""
        self.token_ids: list[int] = []
        self.streamed = False  # a tool call went out (the finish reason becomes "tool_calls")

    def feed(self, delta_text: str, final: bool, delta_token_ids: Sequence[int] = ()) -> dict[str, Any] | None:
        previous, self.text = self.text, self.text + delta_text
        previous_ids, self.token_ids = self.token_ids, self.token_ids + list(delta_token_ids)
        delta: dict[str, Any] | None
        if self.named is not None:
            delta = self.named.feed(delta_text)
        elif self.json_form:
            delta = required_call_deltas(previous, self.text)
        else:
            assert self.parser is not None
            message = self.parser.extract_tool_calls_streaming(
                previous, self.text, delta_text, previous_ids, self.token_ids, list(delta_token_ids),
                self.tools.request)
            if final:
                message = _finish(self.parser, message)
            delta = delta_dict(message) if message is not None else None
        if delta is not None and delta.get("tool_calls"):
            if not self.tools.parallel_tool_calls:
                delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
            self.streamed = self.streamed or bool(delta["tool_calls"])
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.streamed and self.tools.mode != "named":
            return "tool_calls"
        return reason


def _finish(parser: ToolParser, message: DeltaMessage | None) -> DeltaMessage | None:
    """The last delta of a stream, completed: what a buffering parser still holds (vLLM's finish_streaming of
    engine-based parsers), else the last call's parsed but unsent arguments (vLLM's finalize)."""
    finish = getattr(parser, "finish_streaming", None)
    if finish is not None:
        flushed = finish()
        if flushed is None:
            return message
        if message is None:
            return flushed
        if flushed.content:
            message.content = (message.content or "") + flushed.content
        message.tool_calls = message.tool_calls + flushed.tool_calls
        return message
    if message is not None and message.tool_calls:
        remaining = parser.get_remaining_unstreamed_args()
        if remaining:
            last = message.tool_calls[-1]
            if last.function is None:
                last.function = DeltaFunctionCall()
            last.function.arguments = (last.function.arguments or "") + remaining
    return message
