"""Request fields → one StructuredOutputsParams (vLLM's names). The tools of a chat request are set up in
tokenloom/server/tools.py; their grammar comes from tokenloom/server/tool_grammar.py.

Sources of a constraint, at most one per request (vLLM's rule):
- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag"};
- the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- `tools` with tool_choice "required", a named function, or a strict "auto": the tool parser's
  structural tag (tokenloom/server/tool_grammar.py), which replaces or joins the others.

Everything is checked here (APIError 400 naming the field) before the request reaches the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.errors import APIError
from tokenloom.server.tool_grammar import tool_structured_outputs
from tokenloom.server.tools import ToolSetup

_T = TypeVar("_T")
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


# vLLM's StructuredOutputsParams options for its other backends: disable_additional_properties is what
# xgrammar's strict JSON mode always does (no property the schema does not name), so either value is taken;
# whitespace_pattern (outlines/guidance) has no xgrammar counterpart beyond disable_any_whitespace.
_SO_XGRAMMAR_ALWAYS = ("disable_additional_properties",)
_SO_UNSUPPORTED = {"whitespace_pattern": "use disable_any_whitespace for compact JSON"}


def _so_from_dict(value: Any, field: str) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise APIError(400, f"{field} must be an object", field)
    for key, hint in _SO_UNSUPPORTED.items():
        if value.get(key) is not None:
            raise APIError(400, f"{field}.{key} is not supported by the xgrammar backend ({hint})", field)
    for key in _SO_XGRAMMAR_ALWAYS:
        if key in value and not isinstance(value[key], bool):
            raise APIError(400, f"{field}.{key} must be a boolean", field)
    unknown = [k for k in value if k not in _SO_KEYS + _SO_XGRAMMAR_ALWAYS and value[k] is not None]
    if unknown:
        raise APIError(400, f"{field}: unknown key {unknown[0]!r} (one of {', '.join(_SO_KEYS)})", field)
    if not any(value.get(k) is not None for k in _SO_KEYS if k != "disable_any_whitespace"):
        raise APIError(400, f"{field}: you must use one kind of structured outputs constraint but none are "
                            "specified", field)
    try:
        return StructuredOutputsParams(**{k: v for k, v in value.items() if k in _SO_KEYS})
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{field}: {exc}", field) from None


def _named(field: str, build: Callable[..., _T], *args: Any) -> _T:
    """build(*args), a ValueError from the StructuredOutputsParams it makes (e.g. a schema nested too
    deeply) turned into a 400 naming the request field."""
    try:
        return build(*args)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", field) from None


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise APIError(400, "response_format must be an object", "response_format")
    kind = rf.get("type")
    if kind is None:
        raise APIError(400, "response_format.type is required ('text', 'json_object', 'json_schema' or "
                            "'structural_tag')", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema must be an object when type is 'json_schema'",
                           "response_format")
        if not isinstance(js.get("name"), str):  # vLLM's JsonSchemaResponseFormat: name is required
            raise APIError(400, "response_format.json_schema.name is required (a string)", "response_format")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:  # vLLM: no constraint at all is its 400, not "any JSON object"
            raise APIError(400, "response_format.json_schema has no schema: you must use one kind of structured "
                                "outputs constraint but none are specified (for any JSON object use type "
                                "'json_object')", "response_format")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        import json

        return StructuredOutputsParams(structural_tag=json.dumps({k: v for k, v in rf.items() if k != "type"}))
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "response_format")


def structured_outputs_of(obj: dict[str, Any], tools: ToolSetup | None = None,
                          tool_strict_level: str = "auto") -> StructuredOutputsParams | None:
    """The request's one constraint (None: free text); 400 for two, or for one that is invalid."""
    field, so = requested_structured_outputs(obj, tools, tool_strict_level)
    if so is None:
        return None
    # Imported here: xgrammar (and torch) load in the API process only once a constraint arrives.
    from tokenloom.model.grammar import validate_structured_outputs

    try:
        validate_structured_outputs(so)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"{field}: {exc}", field) from None
    return so


def requested_structured_outputs(obj: dict[str, Any], tools: ToolSetup | None = None, tool_strict_level: str = "auto",
                                 ) -> tuple[str, StructuredOutputsParams | None]:
    """The request field that asks for a constraint, and the constraint as asked (its grammar not compiled yet:
    structured_outputs_of checks that); 400 for two, or for one of the wrong shape."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if obj.get("response_format") is not None:
        so = _named("response_format", _from_response_format, obj["response_format"])
        if so is not None:
            found.append(("response_format", so))
    if obj.get("structured_outputs") is not None:
        found.append(("structured_outputs", _so_from_dict(obj["structured_outputs"], "structured_outputs")))
    for name, key in _GUIDED.items():
        if obj.get(name) is not None:
            found.append((name, _so_from_dict({key: obj[name]}, name)))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(400, f"only one kind of structured output may be requested at a time, got {names}",
                       found[1][0])
    field, so = found[0] if found else ("", None)
    if tools is not None:
        with_tools = _named("tools", tool_structured_outputs, tools, so, tool_strict_level)
        if with_tools is not so:
            field, so = "tools", with_tools
    return field, so
