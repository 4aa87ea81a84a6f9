"""Qwen3-Coder XML tool calls (`--tool-call-parser qwen3_coder`, alias `qwen3_xml`; the Qwen3 and Qwen3-MoE
families), vLLM 0.32's rules (vLLM: parser/qwen3.py on its parser engine, parser/engine/*):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The text is read by a small state machine over the format's markers (`_TRANSITIONS`): text before a call
is content; `<tool_call>` (or a bare `<function=`, when the model left the wrapper out) starts a call, the
text up to `>` is its name, everything up to `</function>` its body. A body's `<parameter=NAME>VALUE
</parameter>` pairs become the arguments object (one newline around each value is markup; a missing
`</parameter>` ends at the next `<parameter=`), each value typed by the tool's schema (schema_types.py:
`3` is 3 for an integer parameter, "3" for a string one; without a schema every value is a string).
Special tokens of the tokenizer that are not markers are dropped from the text. `<think>` and `</think>`
stay text: tokenloom has no reasoning parser, and vLLM without one passes them through the same way.

Whole output: every call with a name; content is the text before the first call, stripped when there are
calls (None when empty).
An output that ends inside a call (max_tokens) keeps the parameter it was writing, whole and streamed alike,
so both give the same valid JSON. vLLM drops that parameter from the whole response while its stream has
already sent its start (`{"city": "Par`), which then never closes: a deliberate difference.
Streaming: markers are held back while they may still be forming. A call is announced (index, id, type,
name) once its first body text arrives; its arguments go out as the longest prefix of the arguments'
JSON that cannot change (a string value as it grows, any other value once the next parameter or
`</function>` closes it); what remains goes with `</function>`, or with `finish_streaming` at the end of
the output. Whitespace alone before the first call is not sent, and text after a call is not content:
the whole response drops it (vLLM's rule), so the stream does too. vLLM streams it (a stray
`</tool_call>` the model adds after a forced call, say), so its stream and whole response differ there.

The parser reads text, not token ids: a vocabulary without `<tool_call>` as one token (SmolLM2's) works
too, as in vLLM, which checks no token at start-up for this format. Unlike vLLM, which once it has seen
token ids takes `<tool_call>` only from its own token id, a `<tool_call>` the model spelled in pieces is
a marker here as well.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from tokenloom.server.tool_parsers.base import ToolParser, find_tool_properties, tool_function
from tokenloom.server.tool_parsers.messages import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from tokenloom.server.tool_parsers.schema_types import coerce_arguments, extract_types_from_schema

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END, NAME_END = "<function=", "</function>", ">"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
# Markers with no transition of their own: held back while forming, then text of whatever state reads them.
_INERT_MARKERS = (PARAMETER_START, PARAMETER_END, "<think>", "</think>")

_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_PARTIAL_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)
_JSON_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


class _State(Enum):
    CONTENT = auto()
    PREAMBLE = auto()  # after <tool_call>, before <function=
    NAME = auto()
    BODY = auto()
    BETWEEN = auto()  # after </function>


_START, _END = "start", "end"
_CUT = "cut"  # the value of an end event that is the output's end, not `</function>` or `</tool_call>`
# state -> marker -> (next state, what it means for the call list)
_TRANSITIONS: dict[_State, dict[str, tuple[_State, str | None]]] = {
    _State.CONTENT: {TOOL_CALL_START: (_State.PREAMBLE, _START), FUNCTION_START: (_State.NAME, _START)},
    _State.PREAMBLE: {TOOL_CALL_END: (_State.CONTENT, _END), FUNCTION_START: (_State.NAME, None)},
    _State.NAME: {NAME_END: (_State.BODY, None), FUNCTION_END: (_State.BETWEEN, _END)},
    _State.BODY: {FUNCTION_END: (_State.BETWEEN, _END)},
    _State.BETWEEN: {TOOL_CALL_END: (_State.CONTENT, None), TOOL_CALL_START: (_State.PREAMBLE, _START),
                     FUNCTION_START: (_State.NAME, _START)},
}
_TEXT_KIND = {_State.CONTENT: "text", _State.NAME: "name", _State.BODY: "body"}  # other states drop text


def trim_wrapping_newlines(value: str) -> str:
    """One newline on each side of a value is the template's markup, the rest is the value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parameters_json(body: str, partial: bool) -> str:
    """A call body's parameters as a JSON object of strings; `partial`: the last parameter may be unfinished."""
    params = {m.group(1): trim_wrapping_newlines(m.group(2)) for m in _PARAM.finditer(body)}
    if partial:
        last = _PARTIAL_PARAM.search(_PARAM.sub("", body))
        if last and last.group(1):
            params[last.group(1)] = trim_wrapping_newlines(last.group(2))
    return json.dumps(params, ensure_ascii=False)


def stable_prefix(args_json: str, string_keys: set[str] | None) -> str:
    """The part of a growing arguments object that later text cannot change (vLLM's _safe_arg_prefix): every
    value before the last, then the last one's key, and its text so far if it is a string that stays one
    (`string_keys`; None: no schema, every value stays a string)."""
    last_colon, last_key, pending_key = -1, None, None
    in_string = escape = False
    string_start, depth = -1, 0
    for i, c in enumerate(args_json):
        if escape:
            escape = False
        elif in_string:
            if c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if depth == 1:
                    pending_key = args_json[string_start + 1:i]
        elif c == '"':
            in_string, string_start = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon, last_key, pending_key = i, pending_key, None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(args_json) and args_json[end] in " \t\n\r":
        end += 1
    if end >= len(args_json) or args_json[end] != '"' or (string_keys is not None and last_key not in string_keys):
        return args_json[:end]
    escape = False
    for i in range(end + 1, len(args_json)):
        if escape:
            escape = False
        elif args_json[i] == "\\":
            escape = True
        elif args_json[i] == '"':
            return args_json[:i]  # the closing quote waits: the value may still grow
    return args_json


@dataclass
class _Call:
    """One call as it is read: its name and body text, and what of it was streamed."""

    id: str = ""
    name: str = ""
    body: str = ""
    name_sent: bool = False
    cut: bool = False  # the output ended inside it
    string_keys: set[str] | None = None  # parameters whose partial string values may stream
    streamed_json: str = ""


@dataclass
class _Event:
    kind: str  # "text" | "name" | "body" | _START | _END
    value: str = ""
    index: int = -1


@dataclass
class _Scanner:
    """The text → events half: markers found and held back across deltas, the state they move."""

    markers: tuple[str, ...]
    dropped: frozenset[str]
    state: _State = _State.CONTENT
    index: int = -1  # of the current call
    pending: str = ""  # text that may be the start of a marker
    pattern: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        every = sorted(set(self.markers) | self.dropped, key=len, reverse=True)
        self.pattern = re.compile("|".join(re.escape(m) for m in every))
        self.prefixes = {m[:k] for m in every for k in range(1, len(m))}

    def feed(self, text: str) -> list[_Event]:
        self.pending += text
        events: list[_Event] = []
        pos = 0
        for match in self.pattern.finditer(self.pending):
            self._text(self.pending[pos:match.start()], events)
            self._marker(match.group(), events)
            pos = match.end()
        rest = self.pending[pos:]
        hold = next((k for k in range(len(rest), 0, -1) if rest[-k:] in self.prefixes), 0)
        self._text(rest[:len(rest) - hold], events)
        self.pending = rest[len(rest) - hold:]
        return events

    def finish(self) -> list[_Event]:
        events: list[_Event] = []
        self._text(self.pending, events)
        self.pending = ""
        if self.state is not _State.CONTENT:
            if self.index >= 0:
                events.append(_Event(_END, _CUT, self.index))
            self.state = _State.CONTENT
        return events

    def _text(self, text: str, events: list[_Event]) -> None:
        kind = _TEXT_KIND.get(self.state)
        if text and kind is not None:
            events.append(_Event(kind, text, self.index))

    def _marker(self, marker: str, events: list[_Event]) -> None:
        if marker in self.dropped:
            return
        transition = _TRANSITIONS[self.state].get(marker)
        if transition is None:
            self._text(marker, events)
            return
        self.state, effect = transition
        if effect == _START:
            self.index += 1
        if effect is not None:
            events.append(_Event(effect, index=self.index))


class Qwen3CoderToolParser(ToolParser):
    structural_tag_model = "qwen_3_coder"  # xgrammar's builtin: forced calls are read by this parser
    keeps_special_tokens = True  # vLLM's parser engine keeps them and drops the ones that are not markers
    tools_prompt = """# Tools

You have access to the following functions:

<tools>
{tools}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call>"""

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._markers = (TOOL_CALL_START, TOOL_CALL_END, FUNCTION_START, FUNCTION_END, NAME_END, *_INERT_MARKERS)
        self._dropped = self._droppable_special_tokens()
        self._reset()

    def _droppable_special_tokens(self) -> frozenset[str]:
        try:
            special = list(self.model_tokenizer.all_special_tokens)
        except (AttributeError, NotImplementedError):
            return frozenset()
        return frozenset(t for t in special if isinstance(t, str) and t and t not in self._markers)

    def _reset(self) -> None:
        self._scanner = _Scanner(self._markers, self._dropped)
        self._calls: list[_Call] = []
        self._deferred_content = ""  # text after a call in the same delta, or whitespace before any call
        self._content_started = False  # non-whitespace content went out
        self._suppressed = False  # tool_choice "none": calls are not read

    def _read_request(self, request: Any) -> None:
        """vLLM's engine takes the request's tools over the constructor's, and reads no call under "none"."""
        request_tools = getattr(request, "tools", None)
        if request_tools:
            self.tools = [t for t in request_tools if tool_function(t) is not None]
            if getattr(request, "tool_choice", None) == "none":
                self._suppressed = True

    # Whole output --------------------------------------------------------------------------------
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        self._reset()
        self._read_request(request)
        events = self._scanner.feed(model_output) + self._scanner.finish()
        delta = self._to_delta(events, finished=True)
        calls = [call for i in range(len(self._calls)) if (call := self._whole_call(i)) is not None]
        content = delta.content if delta is not None else None
        if content and calls:
            content = content.strip()
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=content or None)

    def _whole_call(self, index: int) -> ToolCall | None:
        call = self._calls[index]
        if not call.name and not call.body:
            return None
        name, body = call.name.strip(), call.body
        if not name and body.strip():
            name, args = _name_and_args(body)
        elif body.strip():
            args = parameters_json(body, partial=call.cut)
        else:
            args = "{}"
        if not name:
            return None
        call.id = call.id or make_tool_call_id()
        return ToolCall(id=call.id, function=FunctionCall(name=name, arguments=self._typed(args, name)))

    # Streaming -----------------------------------------------------------------------------------
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        if not previous_text:  # a new output (a parser object may be used for more than one)
            self._reset()
        self._read_request(request)
        return self._to_delta(self._scanner.feed(delta_text), finished=False)

    def finish_streaming(self) -> DeltaMessage | None:
        """What the end of the output settles: held-back text, an unclosed call (vLLM's engine-based parsers'
        hook, which the server calls once the stream ends)."""
        events = self._scanner.finish()
        if events or self._deferred_content:
            return self._to_delta(events, finished=True)
        return None

    def _to_delta(self, events: list[_Event], finished: bool) -> DeltaMessage | None:
        """One delta from a delta's events (vLLM's _events_to_delta, same rules for content and calls, but for
        text after an announced call: never content, whole or streamed; see the module's doc)."""
        if not events and not self._deferred_content:
            return None
        deltas: list[DeltaToolCall] = []
        content_parts: list[str] = []
        carried = self._deferred_content
        saw_call = False
        announced_before = self._announced()
        for event in events:
            if event.kind == "text":
                if saw_call:
                    self._deferred_content += event.value
                elif not announced_before:
                    content_parts.append(event.value)
            elif not self._suppressed:
                saw_call = True
                self._on_call_event(event, deltas)
        deltas = _merge_by_index(deltas)
        if self._deferred_content and self._announced():
            self._deferred_content = ""  # text after a call
        elif self._deferred_content and (not saw_call or not deltas):
            deferred_now = self._deferred_content[len(carried):]
            content_parts = ([carried] if carried else []) + content_parts + ([deferred_now] if deferred_now else [])
            self._deferred_content = ""
        content = self._content_to_send("".join(content_parts), finished)
        if content or deltas:
            return DeltaMessage(content=content or None, tool_calls=deltas)
        return None

    def _announced(self) -> bool:
        return any(call.name_sent for call in self._calls)

    def _content_to_send(self, content: str, finished: bool) -> str:
        """Whitespace before any call or content waits (it may precede a call, and then it is dropped)."""
        if self._content_started or not content:
            return content
        if content.strip():
            self._content_started = True
            return content
        if self._calls:
            return ""
        if not finished:
            self._deferred_content = content
            return ""
        return content

    def _on_call_event(self, event: _Event, deltas: list[DeltaToolCall]) -> None:
        if event.kind == _START:
            while len(self._calls) <= event.index:
                self._calls.append(_Call())
        elif event.kind == "name":
            self._calls[event.index].name += event.value
        elif event.kind == "body":
            self._on_body(event, deltas)
        elif event.kind == _END and event.index < len(self._calls):
            self._calls[event.index].cut = event.value == _CUT
            self._on_end(event.index, deltas)

    def _on_body(self, event: _Event, deltas: list[DeltaToolCall]) -> None:
        call = self._calls[event.index]
        call.body += event.value
        if not call.name_sent:
            name = call.name or (_json_name(call.body) if event.value else "")
            if name:
                self._announce(event.index, name, deltas)
        elif (diff := self._arguments_diff(call)) is not None:
            deltas.append(DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=diff)))

    def _on_end(self, index: int, deltas: list[DeltaToolCall]) -> None:
        call = self._calls[index]
        remaining = self._final_arguments_diff(call)
        if not call.name_sent:
            name = call.name or _json_name(call.body)
            if name:
                self._announce(index, name, deltas, remaining or "")
                return
        if remaining and call.name_sent:
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=remaining)))

    def _announce(self, index: int, name: str, deltas: list[DeltaToolCall], arguments: str | None = None) -> None:
        call = self._calls[index]
        call.name, call.name_sent = name, True
        call.string_keys = _string_keys(find_tool_properties(self.tools, name))
        call.id = call.id or make_tool_call_id()
        deltas.append(DeltaToolCall(index=index, id=call.id, type="function",
                                    function=DeltaFunctionCall(name=name, arguments=arguments)))

    def _arguments_diff(self, call: _Call) -> str | None:
        """New arguments text that later text cannot change, or None."""
        safe = stable_prefix(self._typed(parameters_json(call.body, partial=True), call.name), call.string_keys)
        if not safe or safe == call.streamed_json or not safe.startswith(call.streamed_json):
            return None
        diff, call.streamed_json = safe[len(call.streamed_json):], safe
        return diff

    def _final_arguments_diff(self, call: _Call) -> str | None:
        final = parameters_json(call.body, partial=call.cut)
        if final:
            final = self._typed(final, call.name)
        if len(final) <= len(call.streamed_json) or not final.startswith(call.streamed_json):
            return None
        diff, call.streamed_json = final[len(call.streamed_json):], final
        return diff

    def _typed(self, args_json: str, name: str) -> str:
        """The arguments with each value typed by the tool's schema (unchanged without one)."""
        if not self.tools or not name:
            return args_json
        try:
            args = json.loads(args_json)
        except ValueError:
            return args_json
        properties = find_tool_properties(self.tools, name)
        if not isinstance(args, dict) or not properties or not coerce_arguments(args, properties):
            return args_json
        return json.dumps(args, ensure_ascii=False)


def _string_keys(properties: dict[str, Any]) -> set[str] | None:
    """Parameters whose value is a string whatever the model writes (None: no schema, all are strings)."""
    if not properties:
        return None
    return {key for key, schema in properties.items() if set(extract_types_from_schema(schema)) == {"string"}}


def _json_name(body: str) -> str:
    """The name of a body written as a JSON call object, "" when it has none (yet)."""
    match = _JSON_NAME.search(body)
    return match.group(1) if match else ""


def _name_and_args(body: str) -> tuple[str, str]:
    """A body that is a JSON call object ({"name", "arguments" | "parameters"}) instead of parameters."""
    body = body.strip()
    try:
        parsed = json.loads(body)
    except ValueError:
        return "", body
    if not isinstance(parsed, dict):
        return "", body
    name = parsed.get("name", "")
    if not isinstance(name, str):  # vLLM's FunctionCall would reject it, failing the whole response
        return "", body
    for key in ("arguments", "parameters"):
        if key in parsed:
            value = parsed[key]
            return name, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return name, json.dumps({k: v for k, v in parsed.items() if k != "name"}, ensure_ascii=False)


def _merge_by_index(deltas: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """One entry per call in a delta (vLLM's _coalesce_tool_call_deltas)."""
    merged: dict[int, DeltaToolCall] = {}
    for tc in deltas:
        into = merged.setdefault(tc.index, tc)
        if into is tc:
            continue
        into.id = into.id or tc.id
        into.type = into.type or tc.type
        if tc.function is None:
            continue
        if into.function is None:
            into.function = tc.function
            continue
        into.function.name = into.function.name if into.function.name is not None else tc.function.name
        if tc.function.arguments is not None:
            into.function.arguments = (into.function.arguments or "") + tc.function.arguments
    return list(merged.values()) if len(merged) != len(deltas) else deltas
