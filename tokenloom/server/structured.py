"""Request fields → one StructuredOutputsParams (vLLM's names), and the tool setup of a chat request.

Sources of a constraint, at most one per request (vLLM's rule):
- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag"};
- the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- `tools` with tool_choice "required" or a named function (vLLM: get_json_schema_from_tools).

Everything is checked here (APIError 400 naming the field) before the request reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.errors import APIError

_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class ToolSetup:
    """What a chat request asked of tools: the mode, the tools by name, the forced function."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: dict[str, dict[str, Any]]  # name -> the tool's "function" object
    named: str | None = None
    parallel_tool_calls: bool = True  # False: at most one call (vLLM: maxItems 1 under "required")

    @property
    def parses_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")


def _so_from_dict(value: Any, field: str) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise APIError(400, f"{field} must be an object", field)
    unknown = [k for k in value if k not in _SO_KEYS and value[k] is not None]
    if unknown:
        raise APIError(400, f"{field}: unknown key {unknown[0]!r} (one of {', '.join(_SO_KEYS)})", field)
    try:
        return StructuredOutputsParams(**{k: v for k, v in value.items() if k in _SO_KEYS})
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{field}: {exc}", field) from None


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise APIError(400, "response_format must be an object", "response_format")
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema must be an object when type is 'json_schema'",
                           "response_format")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            # OpenAI allows a schema-less json_schema: any JSON object.
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        import json

        return StructuredOutputsParams(structural_tag=json.dumps({k: v for k, v in rf.items() if k != "type"}))
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "response_format")


def structured_outputs_of(obj: dict[str, Any], tools: ToolSetup | None = None) -> StructuredOutputsParams | None:
    """The request's one constraint (None: free text); 400 for two, or for one that is invalid."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if obj.get("response_format") is not None:
        so = _from_response_format(obj["response_format"])
        if so is not None:
            found.append(("response_format", so))
    if obj.get("structured_outputs") not in (None, {}):
        found.append(("structured_outputs", _so_from_dict(obj["structured_outputs"], "structured_outputs")))
    for name, key in _GUIDED.items():
        if obj.get(name) is not None:
            found.append((name, _so_from_dict({key: obj[name]}, name)))
    if tools is not None and tools.mode in ("required", "named"):
        found.append(("tool_choice", StructuredOutputsParams(json=tool_call_schema(tools))))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(400, f"only one kind of structured output may be requested at a time, got {names}",
                       found[1][0])
    if not found:
        return None
    field, so = found[0]
    # Imported here: xgrammar (and torch) load in the API process only once a constraint arrives.
    from tokenloom.model.grammar import validate_structured_outputs

    try:
        validate_structured_outputs(so)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", field) from None
    return so


# Tools -----------------------------------------------------------------------------------------------
def tool_setup(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None = None) -> ToolSetup | None:
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "when using tool_choice, tools must be set", "tool_choice")
        return None
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools.{i}.function.name must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.function.parameters must be a JSON schema object", "tools")
        by_name[name] = fn
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                f"got {tool_choice!r}", "tool_choice")
        return ToolSetup(tool_choice, by_name, parallel_tool_calls=parallel_tool_calls is not False)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in by_name:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(by_name) or 'none'})", "tool_choice")
    return ToolSetup("named", by_name, name, parallel_tool_calls=parallel_tool_calls is not False)


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def tool_call_schema(tools: ToolSetup) -> dict[str, Any]:
    """vLLM's schema: a named call is the function's arguments; `required` is a non-empty array of
    {"name", "parameters"} objects, one alternative per tool."""
    if tools.mode == "named":
        assert tools.named is not None
        return _parameters(tools.tools[tools.named])
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(fn)},
                 "required": ["name", "parameters"]}
                for name, fn in tools.tools.items()
            ],
        },
    }
    if not tools.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def render_tools(tools: ToolSetup | None) -> list[dict[str, Any]] | None:
    """Tools for the chat template (apply_chat_template(tools=...)); none when the model may not call."""
    if tools is None or tools.mode == "none":
        return None
    return [{"type": "function", "function": fn} for fn in tools.tools.values()]
