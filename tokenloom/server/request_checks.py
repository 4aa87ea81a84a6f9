"""vLLM's request-body validators (its pydantic model validators in chat_completion/protocol.py,
completion/protocol.py and responses/protocol.py), run by tokenloom's request models before their fields
are validated (tokenloom/server/protocol.py), with vLLM's 400 messages and defaults.

- `tool_choice`: chat defaults it to "auto" when tools are given, else "none" (an explicit null stays
  null); Responses defaults it to "auto", which becomes "none" without tools. Refused in vLLM's words:
  chat's empty `tools` array, a tool_choice without tools, an unknown tool_choice, a named function that is
  malformed or not among the tools; Responses' "required" or a named function without tools, and a named
  function it cannot find (a namespace's function may be named by its own name when that is unambiguous).
- `structured_outputs`: at most one of json / regex / choice; and on chat, not with a named function.
- Responses' custom tools: a grammar format is refused (only free-form text custom tools).

An APIError raised here leaves pydantic as it is (pydantic wraps only ValueError): the client gets vLLM's
message and `param`, not a field-validation summary.
"""

from __future__ import annotations

from typing import Any

from tokenloom.server.errors import APIError

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_structured_outputs_count(data: Any, chat: bool) -> None:
    so = data.get("structured_outputs") if isinstance(data, dict) else None
    if not isinstance(so, dict):
        return
    count = sum(so.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        raise APIError(400, "You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                            "'choice').", "structured_outputs")
    if chat and count > 0 and data.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise APIError(400, "You can only either use constraints for structured outputs or tools, not both.",
                       "structured_outputs")


def check_chat_tool_usage(data: Any) -> Any:
    """The chat body with tool_choice defaulted (vLLM's ChatCompletionRequest.check_tool_usage)."""
    if not isinstance(data, dict):
        return data
    if data.get("tools") == []:
        raise APIError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the "
                            "field entirely.", "tools")
    if "tool_choice" not in data:
        data = {**data, "tool_choice": "auto" if data.get("tools") else "none"}
    choice = data["tool_choice"]
    if choice is None or choice == "none":
        return data
    if data.get("tools") is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise APIError(400, f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                            "\"required\" are supported.", "tool_choice")
    if isinstance(choice, dict):
        _check_named_choice(choice, data["tools"])
    return data


def _check_named_choice(choice: dict[str, Any], tools: Any) -> None:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise APIError(400, f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}",
                       "tool_choice.function")
    if "name" not in function:
        raise APIError(400, f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}",
                       "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise APIError(400, f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}",
                       "tool_choice.function.name")
    names = {t["function"].get("name") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)} \
        if isinstance(tools, list) else set()
    if name not in names:
        raise APIError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                       "tool_choice")


NAMESPACE_SEPARATOR = "__"  # vLLM's _NAMESPACE_TOOL_SEPARATOR


def flat_tool_name(namespace: str, name: str) -> str:
    """vLLM's flat_namespace_tool_name: a namespace's function as the model sees it."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def check_custom_tool_format(data: Any) -> None:
    """vLLM's ResponsesRequest.check_custom_tool_format: only free-form text custom tools."""
    tools = data.get("tools") if isinstance(data, dict) else None
    for tool in tools if isinstance(tools, list) else []:
        fmt = tool.get("format") if isinstance(tool, dict) else None
        if isinstance(fmt, dict) and tool.get("type") == "custom" and fmt.get("type") == "grammar":
            raise APIError(400, "Custom tools with a grammar format are not supported; only free-form text custom "
                                "tools are accepted.", "tools")


def check_responses_tool_usage(data: Any) -> Any:
    """The Responses body with tool_choice resolved (vLLM's ResponsesRequest.check_tool_usage)."""
    if not isinstance(data, dict):
        return data
    tools = data.get("tools")
    choice = data.get("tool_choice", "auto")
    has_tools = bool(tools) if isinstance(tools, list) else tools is not None
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not has_tools:
        if choice in ("auto", "none"):
            return {**data, "tool_choice": "none"}
        if choice == "required":
            raise APIError(400, "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        if named:
            raise _not_found()
        return data
    if named and isinstance(tools, list):
        name = choice.get("name")
        if not name:
            raise _not_found()
        resolved = resolve_named_tool_choice(name, tools)
        if resolved != name:
            return {**data, "tool_choice": {**choice, "name": resolved}}
    return data


def _not_found() -> APIError:
    return APIError(400, "Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


def resolve_named_tool_choice(name: str, tools: list[Any]) -> str:
    """vLLM's _resolve_named_tool_choice: a tool's own name, or a namespace's function named by its own name
    when only one namespace has it (its flat `<namespace>__<name>` then)."""
    exact: set[str] = set()
    by_local_name: dict[str, list[str]] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(inner, list) or not isinstance(namespace, str):
                return name  # malformed: the Responses tool checks say so
            for fn in inner:
                local = fn.get("name") if isinstance(fn, dict) else None
                if isinstance(local, str):
                    exact.add(flat_tool_name(namespace, local))
                    by_local_name.setdefault(local, []).append(flat_tool_name(namespace, local))
        elif isinstance(tool.get("name"), str):
            exact.add(tool["name"])
        elif isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str):
            exact.add(tool["function"]["name"])  # chat's shape, which tokenloom takes leniently
    if name in exact:
        return name
    candidates = by_local_name.get(name, [])
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise APIError(400, f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
                            f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.",
                       "tool_choice")
    raise _not_found()
