"""vLLM's JSON forms of forced tool calls, for parsers without a structural tag (pythonic here):
tool_choice "required" is a JSON array `[{"name": ..., "parameters": {...}}, ...]` (minItems 1, maxItems 1
with `parallel_tool_calls: false`), a named function is that function's arguments object alone. The
request's constraint becomes that schema (vLLM: ToolParser.adjust_request with
get_json_schema_from_tools), and the output is read by these rules, not by the model's parser
(vLLM: DelegatingParser._extract_tool_calls, tool_parsers/streaming.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from tokenloom.server.tool_parsers.messages import make_tool_call_id


def make_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call as the response's message carries it (`arguments`: JSON text)."""
    return {"id": make_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def params_or_empty_object(params: dict[str, Any] | None) -> dict[str, Any]:
    # Empty or missing parameters still hold the arguments to a JSON object.
    return params if params else {"type": "object", "properties": {}}


def json_schema_from_tools(tools: dict[str, dict[str, Any]], mode: str, named: str | None,
                           parallel_tool_calls: bool) -> dict[str, Any] | None:
    """The schema forcing `mode` ("required" | "named"), None otherwise. ValueError: two tools define one
    `$defs` name differently (vLLM's message)."""
    if mode == "named" and named is not None:
        return params_or_empty_object(tools[named].get("parameters"))
    if mode != "required":
        return None
    any_of = []
    all_defs: dict[str, Any] = {}
    for name, fn in tools.items():
        params = copy.deepcopy(fn.get("parameters"))
        if params is not None:
            defs = params.pop("$defs", {})
            if not isinstance(defs, dict):
                raise ValueError(f"`$defs` in the parameters of tool '{name}' must be an object, got "
                                 f"{type(defs).__name__}.")
            for def_name, def_schema in defs.items():
                if def_name in all_defs and all_defs[def_name] != def_schema:
                    raise ValueError(f"Tool definition '{def_name}' has multiple schemas, which is not "
                                     "supported.")
                all_defs[def_name] = def_schema
        any_of.append({"properties": {"name": {"type": "string", "enum": [name]},
                                      "parameters": params_or_empty_object(params)},
                       "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": any_of}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if all_defs:
        schema["$defs"] = all_defs
    return schema


class _FunctionDefinition(BaseModel):
    """vLLM's FunctionDefinition, the shape each array element is validated against."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


_CALL_LIST = TypeAdapter(list[_FunctionDefinition])


def parse_required(text: str) -> list[dict[str, Any]]:
    """The calls of a "required" array; none when it does not validate (vLLM suppresses the error)."""
    try:
        parsed = _CALL_LIST.validate_json(text or "")
    except ValidationError:
        return []
    return [make_call(fd.name, json.dumps(fd.parameters, ensure_ascii=False)) for fd in parsed]


def parse_named(text: str, name: str) -> list[dict[str, Any]]:
    """The one call of a named function: the output is its arguments, as the model wrote them."""
    if not text.strip():
        return []
    return [make_call(name, text)]


# Streaming -------------------------------------------------------------------------------------------
class NamedCallStreamer:
    """vLLM's extract_named_tool_call_streaming: the call announced with the first delta, every delta's
    text is arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.name_returned = False

    def feed(self, delta_text: str) -> dict[str, Any]:
        if self.name_returned:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta_text}}
        else:
            call = {"index": 0, "id": make_tool_call_id(), "type": "function",
                    "function": {"name": self.name, "arguments": delta_text}}
            self.name_returned = True
        return {"content": None, "tool_calls": [call]}


@dataclass
class _CallSpan:
    """Where one array element sits in the text (vLLM's _RequiredToolCallSpan): the name once its string
    closed and decoded, and the span of the "parameters" value (end None while it is being written).
    Offsets are prefix-stable: a prefix of the text scans to the same spans, truncated."""

    name: str | None = None
    name_end: int | None = None
    args_start: int | None = None
    args_end: int | None = None

    def ready_at(self, length: int) -> bool:
        return (self.name is not None and self.name_end is not None and self.name_end <= length
                and self.args_start is not None and self.args_start < length)

    @property
    def ready(self) -> bool:
        return self.name is not None and self.args_start is not None


_EXPECT_KEY, _EXPECT_COLON, _EXPECT_VALUE, _IN_STRING, _IN_CONTAINER, _IN_SCALAR, _AFTER_VALUE = range(7)


def scan_required_calls(text: str) -> list[_CallSpan]:
    """vLLM's _scan_required_tool_calls: one string- and nesting-aware pass over a (partial) array."""
    spans: list[_CallSpan] = []
    depth = 0  # of {} and []: element objects sit at 2
    in_string = escaped = False
    string_start = value_start = 0
    cur: _CallSpan | None = None
    expect = _EXPECT_KEY
    key: str | None = None

    def end_value(pos: int) -> None:
        nonlocal expect
        assert cur is not None
        if key == "parameters":
            cur.args_end = pos
        elif key == "name" and expect == _IN_STRING:
            try:
                cur.name = json.loads(text[value_start:pos])
                cur.name_end = pos
            except json.JSONDecodeError:
                cur.name = None  # never ready, as the whole-response path rejects the array
        expect = _AFTER_VALUE

    def start_value(pos: int, state: int) -> None:
        nonlocal expect, value_start
        assert cur is not None
        value_start = pos
        if key == "parameters":
            cur.args_start = pos
        expect = state

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and cur is not None:
                    if expect == _EXPECT_KEY:
                        key = text[string_start + 1: i]
                        expect = _EXPECT_COLON
                    elif expect == _IN_STRING:
                        end_value(i + 1)
            continue
        if ch == '"':
            in_string = True
            string_start = i
            if depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                start_value(i, _IN_STRING)
            continue
        if ch in "{[":
            if depth == 0:
                if ch != "[":
                    return spans
            elif depth == 1:
                if ch != "{":
                    return spans
                cur = _CallSpan()
                spans.append(cur)
                expect = _EXPECT_KEY
                key = None
            elif depth == 2 and cur is not None and expect == _EXPECT_VALUE:
                start_value(i, _IN_CONTAINER)
            depth += 1
            continue
        if ch in "}]":
            if depth == 2 and cur is not None and expect == _IN_SCALAR:
                end_value(i)
            depth -= 1
            if depth == 2 and cur is not None and expect == _IN_CONTAINER:
                end_value(i + 1)
            elif depth == 1:
                cur = None
            elif depth <= 0:
                return spans
            continue
        if depth != 2 or cur is None:
            continue
        if ch == ":":
            if expect == _EXPECT_COLON:
                expect = _EXPECT_VALUE
        elif ch == ",":
            if expect == _IN_SCALAR:
                end_value(i)
            expect = _EXPECT_KEY
            key = None
        elif ch.isspace():
            if expect == _IN_SCALAR:
                end_value(i)
        elif expect == _EXPECT_VALUE:
            start_value(i, _IN_SCALAR)
    return spans


def required_call_deltas(previous_text: str, current_text: str) -> dict[str, Any] | None:
    """vLLM's extract_required_tool_call_streaming: every element with something unsent, in order; a
    call's first delta carries its id, name and the arguments so far, later ones only new text."""
    if not current_text:
        return None
    spans = scan_required_calls(current_text)
    sent_len = len(previous_text)
    tool_calls: list[dict[str, Any]] = []
    for index, span in enumerate(spans):
        if not span.ready:
            break  # elements are written in order: nothing later can be ready
        assert span.args_start is not None
        end = span.args_end if span.args_end is not None else len(current_text)
        if span.ready_at(sent_len):
            new_arguments = current_text[min(end, sent_len):end]
            if new_arguments:
                tool_calls.append({"index": index, "function": {"arguments": new_arguments}})
            continue
        tool_calls.append({"index": index, "id": make_tool_call_id(), "type": "function",
                           "function": {"name": span.name, "arguments": current_text[span.args_start:end]}})
    if not tool_calls:
        return None
    return {"content": None, "tool_calls": tool_calls}
