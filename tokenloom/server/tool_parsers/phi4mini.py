"""Phi-4-mini JSON tool calls (`--tool-call-parser phi4_mini_json`; the phi3 family): a JSON array of calls
after the word `functools` (vLLM: tool_parsers/phi4mini_tool_parser.py),

    functools[{"name": "get_weather", "arguments": {"city": "Tokyo"}}, {"name": ..., "parameters": {...}}]

Whole output: the array after the first `functools[`; each element needs a string "name" and "arguments"
or "parameters" (re-serialised with json.dumps); then content is None, as vLLM drops the text around the
calls. Anything else leaves the whole text as content. Two deliberate differences from vLLM 0.32, whose
own tests mark both as its bugs: the array is decoded as JSON from its `[` (vLLM cuts it at the first `]`,
so an argument holding a list broke every call), and an empty or undecodable array is no call at all
(vLLM reported tools_called with no calls, and the text was lost).
Streaming (vLLM's parser sends nothing while streaming; here it streams): text before `functools[` is
content as it comes, holding back a tail that may grow into the marker; in the array each call is
announced once its name is complete and its arguments have begun, and its arguments go out as the
common prefix of successive json.dumps of the partial value (vLLM's llama3_json way), the rest once the
element closes, so the pieces add up to the whole response's arguments. Text after the array is dropped
as in the whole response; an array that closes or ends with no call gives its text back as content.

No special token is needed: vLLM checks none for this format, and `functools` is matched as text.
Forced calls (tool_choice required / named) use vLLM's JSON forms (json_calls.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

from tokenloom.server.tool_parsers.base import ToolParser, find_common_prefix, partial_tag_overlap
from tokenloom.server.tool_parsers.messages import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

logger = logging.getLogger(__name__)
MARKER = "functools["


def call_arguments(element: Any) -> Any:
    """An element's arguments value (KeyError: it has neither key; TypeError: it is not an object)."""
    if not isinstance(element, dict):
        raise TypeError("a tool call must be a JSON object")
    return element["arguments"] if "arguments" in element else element["parameters"]


def split_elements(array_text: str) -> tuple[list[tuple[str, bool]], bool]:
    """The top-level elements of a (partial) JSON array text starting at `[`: (text, complete) each, and
    whether the array closed. String- and nesting-aware, so brackets inside strings are text."""
    elements: list[tuple[str, bool]] = []
    depth, in_string, escaped, start = 0, False, False, -1
    for i, ch in enumerate(array_text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
            if depth == 1:
                start = i if start < 0 else start
        elif ch in "[{":
            if depth == 1 and start < 0:
                start = i
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 1 and start >= 0:
                elements.append((array_text[start:i + 1], True))
                start = -1
            elif depth == 0:
                return elements, True
        elif depth == 1 and start < 0 and not ch.isspace() and ch != ",":
            start = i  # a bare value (a number, true, ...): not a call, but an element
    if start >= 0:
        elements.append((array_text[start:], False))
    return elements, False


class Phi4MiniJsonToolParser(ToolParser):
    tools_prompt = (
        "You are a helpful assistant with some tools.\n<|tool|>[{tools}]<|/tool|>\n"
        'To call tools, reply only with functools[{{"name": <function-name>, "arguments": <args-json-object>}}, '
        "...] and nothing else."
    )

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.bot_token = "functools"
        self._start_stream()

    def _start_stream(self) -> None:
        self.streamed_args_for_tool, self.prev_tool_call_arr = [], []
        self._text = ""  # the output so far
        self._sent_content = 0  # characters of it that went out as content
        self._renderings: list[str] = []  # per call: json.dumps of its partial arguments last time
        self._array_done = False  # the array closed or was given up: later text is not read

    # Whole output --------------------------------------------------------------------------------
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        not_called = ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        start = model_output.find(MARKER)
        if start < 0:
            return not_called
        try:
            array, _ = json.JSONDecoder().raw_decode(model_output[start + len(MARKER) - 1:])
            calls = [ToolCall(function=FunctionCall(
                name=e["name"], arguments=json.dumps(call_arguments(e), ensure_ascii=False))) for e in array]
        except Exception:  # vLLM: an element that is not a call leaves the whole text as content
            logger.debug("no phi4_mini_json tool calls in %r", model_output[:80], exc_info=True)
            return not_called
        if not calls:
            return not_called
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)

    # Streaming -----------------------------------------------------------------------------------
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        if not previous_text:  # a new output (a parser object may be used for more than one)
            self._start_stream()
        self._text = current_text
        start = current_text.find(MARKER)
        if start < 0 or self._array_done and not self.streamed_args_for_tool:
            return self._content(len(current_text) - partial_tag_overlap(current_text, MARKER))
        deltas: list[DeltaToolCall] = []
        if not self._array_done:
            deltas, self._array_done = self._array_deltas(current_text[start + len(MARKER) - 1:])
        # An array that closed with no call was text after all.
        content = self._content(len(current_text) if self._array_done and not self.streamed_args_for_tool
                                else start)
        if deltas:
            return DeltaMessage(content=content.content if content else None, tool_calls=deltas)
        return content

    def finish_streaming(self) -> DeltaMessage | None:
        """The end of the output: a held-back tail, or an array that never closed and called nothing, is
        content (the server calls this once the stream ends)."""
        if self._text.find(MARKER) < 0 or not self.streamed_args_for_tool:
            return self._content(len(self._text))
        return None

    def _content(self, upto: int) -> DeltaMessage | None:
        if upto <= self._sent_content:
            return None
        piece, self._sent_content = self._text[self._sent_content:upto], upto
        return DeltaMessage(content=piece)

    def _array_deltas(self, array_text: str) -> tuple[list[DeltaToolCall], bool]:
        """The calls' new pieces, and whether the array is done (closed, or an element is not a call)."""
        elements, closed = split_elements(array_text)
        deltas: list[DeltaToolCall] = []
        for index, (element, complete) in enumerate(elements):
            try:
                delta = self._call_delta(index, element, complete)
            except Exception:
                if complete:  # an element that is not a call: the array is not read further
                    return deltas, True
                break  # too little of it to read yet
            if delta is not None:
                deltas.append(delta)
        return deltas, closed

    def _call_delta(self, index: int, element: str, complete: bool) -> DeltaToolCall | None:
        """Call `index`'s announcement or its new arguments text, or None."""
        if index > len(self.streamed_args_for_tool):
            return None  # an earlier call is not announced yet
        if complete:
            parsed = json.loads(element)
            name, arguments = parsed["name"], json.dumps(call_arguments(parsed), ensure_ascii=False)
            if not isinstance(name, str):
                raise TypeError("a tool call's name must be a string")
        else:
            parsed = partial_json_parser.loads(element, Allow.ALL & ~Allow.STR)
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or \
                    not ({"arguments", "parameters"} & parsed.keys()):
                return None  # announced once its name is whole and its arguments begin
            name, arguments = parsed["name"], self._stable_arguments(index, element)
        if index == len(self.streamed_args_for_tool):
            self.streamed_args_for_tool.append("")
            self.prev_tool_call_arr.append({"name": name})
            return DeltaToolCall(index=index, id=make_tool_call_id(), type="function",
                                 function=DeltaFunctionCall(name=name, arguments=self._take(index, arguments)))
        diff = self._take(index, arguments)
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=diff)) if diff else None

    def _stable_arguments(self, index: int, element: str) -> str:
        """What two successive renderings of the partial arguments agree on, once they differ (never a
        closing quote or brace that only the completion added; vLLM's llama3_json rule)."""
        parsed = partial_json_parser.loads(element, Allow.ALL)
        value = parsed.get("arguments", parsed.get("parameters")) if isinstance(parsed, dict) else None
        rendering = json.dumps(value, ensure_ascii=False) if value is not None else ""
        while len(self._renderings) <= index:
            self._renderings.append("")
        previous, self._renderings[index] = self._renderings[index], rendering
        if not previous or previous == rendering:
            return ""
        return find_common_prefix(previous, rendering)

    def _take(self, index: int, arguments: str) -> str:
        """The part of `arguments` not sent yet for call `index` (recorded as sent)."""
        sent = self.streamed_args_for_tool[index]
        if not arguments.startswith(sent) or len(arguments) <= len(sent):
            return ""
        self.streamed_args_for_tool[index] = arguments
        return arguments[len(sent):]
