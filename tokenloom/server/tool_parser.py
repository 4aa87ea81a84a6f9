"""Tool calls out of generated text: Hermes/Qwen `<tool_call>` blocks (tool_choice "auto"), and the
JSON a grammar forced (tool_choice "required" or a named function). vLLM: hermes_tool_parser.py and
the required/named branches of serving_chat.py.

Tool-call objects are OpenAI's: {"id", "type": "function", "function": {"name", "arguments"}}, with
`arguments` a JSON string. Streaming sends each call as one delta once it is complete (the shape of
OpenAI's deltas: {"index", "id", "type", "function": {"name", "arguments"}}), content as it comes,
holding back only text that may be the start of a `<tool_call>` tag.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from tokenloom.server.structured import ToolSetup

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

# The Hermes/Qwen 2.5 system prompt, for chat templates that do not render `tools` themselves
# (SmolLM2's does not): the model then sees the tools and the format to call them in.
_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    return _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in str(chat_template)


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call, or None if empty; calls) of a Hermes-format generation. A block
    that is not valid JSON with a "name" is left in the content (vLLM: the text comes back as is)."""
    if TOOL_CALL_START not in text:
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(make_call(obj["name"], obj.get("arguments", {})))
    content = text[: text.index(TOOL_CALL_START)].strip()
    return content or None, calls


def parse_forced(text: str, tools: ToolSetup) -> list[dict[str, Any]] | None:
    """The calls of a grammar-forced generation; None if it did not complete (max_tokens)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if tools.mode == "named":
        assert tools.named is not None
        return [make_call(tools.named, obj)]
    return [make_call(item["name"], item.get("parameters", {})) for item in obj]


def parse_output(text: str, tools: ToolSetup) -> tuple[str | None, list[dict[str, Any]]]:
    """(message content, tool calls) of a whole generation."""
    if tools.mode == "auto":
        return parse_hermes(text)
    calls = parse_forced(text, tools)
    if calls is None:
        return text, []  # unfinished (finish_reason "length"): the partial text, as vLLM returns it
    return None, calls


def finish_reason(reason: str | None, tools: ToolSetup | None, calls: list[dict[str, Any]]) -> str | None:
    # vLLM: "tool_calls" when the model called tools, except for a named tool_choice (stays "stop").
    if calls and reason == "stop" and tools is not None and tools.mode in ("auto", "required"):
        return "tool_calls"
    return reason


class StreamingToolParser:
    """Turns text deltas into (content delta, complete tool calls) as they become known."""

    def __init__(self, tools: ToolSetup) -> None:
        self.tools = tools
        self.text = ""
        self.sent_content = 0  # chars of `text` already sent as content
        self.sent_calls = 0
        self.calls: list[dict[str, Any]] = []

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.tools.mode != "auto":
            if not final:
                return "", []
            content, calls = parse_output(self.text, self.tools)
            return self._emit(content if not calls else None, calls)
        start = self.text.find(TOOL_CALL_START)
        if start < 0:
            # Hold back a tail that could grow into "<tool_call>".
            keep = 0 if final else _partial_tag_len(self.text)
            out = self.text[self.sent_content: len(self.text) - keep]
            self.sent_content += len(out)
            return out, []
        content = self.text[self.sent_content: start]
        self.sent_content = max(self.sent_content, start)
        blocks = self.text[start:]
        done = blocks.count(TOOL_CALL_END)
        calls: list[dict[str, Any]] = []
        if final or done > self.sent_calls:
            parsed_content, parsed = parse_hermes(self.text if final else self.text[: self.text.rindex(TOOL_CALL_END)
                                                                                 + len(TOOL_CALL_END)])
            if not parsed and final:
                # Not a tool call after all: the rest is content.
                content += self.text[self.sent_content:]
                self.sent_content = len(self.text)
            calls = parsed[self.sent_calls:]
        return content, self._record(calls)

    def _emit(self, content: str | None, calls: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        return content or "", self._record(calls)

    def _record(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            deltas.append({"index": self.sent_calls, **call})
            self.sent_calls += 1
            self.calls.append(call)
        return deltas


def _partial_tag_len(text: str) -> int:
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0
