"""Responses tools → the functions the model is shown, and the model's calls back → output items (vLLM 0.32:
tool_parsers/utils.py get_function_tools and build_responses_tool_call_name_map, responses/utils.py
build_response_output_items and decode_custom_tool_input[_prefix]).

- `function` tools (OpenAI's flat shape) are chat's functions;
- a `namespace` tool's functions are shown as `<namespace>__<name>` (its other tools are dropped, as vLLM), and
  a call of one comes back as its own `name` plus `namespace`;
- a `custom` tool (free text in, no JSON schema) is shown as a function of one string argument, `input`
  (vLLM's "function shim"), and a call of it comes back as a `custom_tool_call` item whose `input` is that
  string. Only free-form text custom tools: a grammar format is vLLM's 400 (request_checks.py).
Other tool types (web_search, file_search, code_interpreter, mcp, ...) need a tool server: a 400 naming tools.N.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

from tokenloom.server.errors import APIError
from tokenloom.server.request_checks import flat_tool_name
from tokenloom.server.responses_input import CUSTOM_TOOL_INPUT_KEY


def custom_tool_parameters() -> dict[str, Any]:
    """The JSON schema of the function a custom tool is shown as (vLLM's, word for word)."""
    return {"type": "object",
            "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string",
                                                   "description": "The freeform text payload for this tool."}},
            "required": [CUSTOM_TOOL_INPUT_KEY], "additionalProperties": False}


def _function(fn: dict[str, Any], name: Any = None) -> dict[str, Any]:
    fields = {k: fn[k] for k in ("name", "description", "parameters", "strict") if fn.get(k) is not None}
    return {"type": "function", "function": {**fields, **({"name": name} if name is not None else {})}}


def _namespace_functions(i: int, tool: dict[str, Any]) -> list[dict[str, Any]]:
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace or not isinstance(inner, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in inner):
        raise APIError(400, f"tools.{i}: a namespace tool needs a name and a list of named tools", "tools")
    return [_function(t, flat_tool_name(namespace, t["name"])) for t in inner if t.get("type") == "function"]


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's tools as chat's {"type": "function", "function": {...}}, in request order."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            out += _namespace_functions(i, tool)
        elif kind == "custom":  # the request model checked its name and format
            out.append(_function({"name": tool["name"], "description": tool.get("description"),
                                  "parameters": custom_tool_parameters()}))
        elif kind == "function":
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool  # chat's shape, leniently
            out.append(_function(fn))
        else:
            raise APIError(400, f"tools.{i}.type {kind!r} is not supported: only function, namespace and custom "
                                "tools (built-in tools such as web_search, file_search, code_interpreter and mcp "
                                "need a tool server)", "tools")
    return out


@dataclass(frozen=True)
class ToolNames:
    """How a call's name (the one the model wrote) maps back onto the request's tools."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name → (name, namespace)
    custom: frozenset[str] = frozenset()

    @classmethod
    def of(cls, tools: list[Any] | None) -> ToolNames:
        namespaced: dict[str, tuple[str, str]] = {}
        custom = set()
        for tool in tools or []:
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                continue
            if tool.get("type") == "custom":
                custom.add(tool["name"])
            elif tool.get("type") == "namespace":
                for inner in tool.get("tools") or []:
                    if isinstance(inner, dict) and inner.get("type") == "function" and isinstance(inner.get("name"),
                                                                                                   str):
                        namespaced[flat_tool_name(tool["name"], inner["name"])] = (inner["name"], tool["name"])
        return cls(namespaced, frozenset(custom))

    def is_custom(self, name: str) -> bool:
        return name in self.custom


def _custom_payload(parsed: Any) -> str | None:
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else None


def decode_custom_tool_input(arguments: str) -> str:
    """A finished custom call's text: the `input` of its arguments; arguments that are not that (bare text, other
    keys) are passed through whole, as vLLM does."""
    try:
        payload = _custom_payload(json.loads(arguments))
    except ValueError:
        return arguments
    return arguments if payload is None else payload


def decode_custom_tool_input_prefix(arguments: str) -> str:
    """The longest text of an unfinished custom call's `input` that is sure to begin the final one (a lone high
    surrogate waits for its pair), so that streamed deltas add up to the final input."""
    try:
        parsed = partial_json_parser.loads(arguments, Allow.STR | Allow.OBJ)
    except (ValueError, IndexError, AssertionError):
        return ""
    payload = _custom_payload(parsed) or ""
    if payload and "\ud800" <= payload[-1] <= "\udbff":
        payload = payload[:-1]
    return payload
