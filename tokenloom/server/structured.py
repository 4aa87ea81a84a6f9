"""Request fields → one StructuredOutputsParams (vLLM's names), and the tool setup of a chat request.

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
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.errors import APIError

_T = TypeVar("_T")
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class ToolSetup:
    """What a chat request asked of tools: the mode, the tools by name, the forced function."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: dict[str, dict[str, Any]]  # name -> the tool's "function" object
    named: str | None = None
    parallel_tool_calls: bool = True  # False: at most one call (the grammar stops after it)
    parser: str | None = None  # the server's --tool-call-parser, when --enable-auto-tool-choice is on
    # tool_choice was an explicit null: vLLM parses it as "auto" but never constrains it.
    choice_null: bool = False

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read as tool calls: any mode but "none" with a parser; "required" and a
        named function without one too (vLLM: forced calls use structured outputs, no parser needed)."""
        if self.parser is None:
            return self.mode in ("required", "named")
        return self.mode in ("auto", "required", "named")


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
    if not any(value.get(k) not in (None, False) for k in _SO_KEYS if k != "disable_any_whitespace"):
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
        from tokenloom.server.tool_grammar import tool_structured_outputs

        with_tools = _named("tools", tool_structured_outputs, tools, so, tool_strict_level)
        if with_tools is not so:
            field, so = "tools", with_tools
    if so is None:
        return None
    # Imported here: xgrammar (and torch) load in the API process only once a constraint arrives.
    from tokenloom.model.grammar import validate_structured_outputs

    try:
        validate_structured_outputs(so)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"{field}: {exc}", field) from None
    return so


# Tools -----------------------------------------------------------------------------------------------
def tool_setup(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None = None, parser: str | None = None,
               tool_choice_given: bool = True) -> ToolSetup | None:
    """The request's tools; `parser` is the server's tool-call parser (None: --enable-auto-tool-choice
    is off), `tool_choice_given` whether the body had the key at all (absent with tools means "auto")."""
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
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        # Absent: "auto", OpenAI's default when tools are given (vLLM's validator sets it). An explicit
        # null stays None in vLLM: parsed as "auto" when a parser is on, else plain text.
        # An empty list counts as no tools there (the default stays "none").
        tool_choice = "auto" if by_name and (not tool_choice_given or parser is not None) else "none"
        null = tool_choice_given
    else:
        null = False
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                f"got {tool_choice!r}", "tool_choice")
        return _check_parser(ToolSetup(tool_choice, by_name, parallel_tool_calls=parallel, parser=parser,
                                       choice_null=null))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in by_name:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                            f"({', '.join(by_name) or 'none'})", "tool_choice")
    return _check_parser(ToolSetup("named", by_name, name, parallel_tool_calls=parallel, parser=parser))


def _check_parser(setup: ToolSetup) -> ToolSetup:
    """vLLM's 400s (its words): "auto" needs --enable-auto-tool-choice and a parser; "required" and a named
    function do not (their calls are forced by structured outputs and read as JSON, vLLM's rule)."""
    if setup.mode == "required" and not setup.tools:
        raise APIError(400, "tool_choice requires a function call, but tools contains no function tool the "
                            "model can call.", "tool_choice")
    if setup.mode == "auto" and setup.parser is None:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    return setup


def render_tools(tools: ToolSetup | None, exclude_when_none: bool = False) -> list[dict[str, Any]] | None:
    """Tools for the chat template (apply_chat_template(tools=...)); with tool_choice "none" too, unless
    --exclude-tools-when-tool-choice-none (vLLM)."""
    if tools is None or (tools.mode == "none" and exclude_when_none):
        return None
    return [{"type": "function", "function": fn} for fn in tools.tools.values()]
