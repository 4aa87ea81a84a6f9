"""Tool calls enforced with an xgrammar structural tag, as vLLM 0.32 does for parsers whose format has one
(vLLM: parser/abstract_parser.py `_apply_structural_tag`, tool_parsers/structural_tag_registry.py).

- tool_choice "required": one or more calls in the parser's format (`<tool_call>...</tool_call>` for
  Hermes), `parallel_tool_calls: false` stops after the first;
- a named function: exactly one call of that function;
- "auto": unconstrained, unless a tool says `"strict": true` (or `--tool-strict-level` is above auto):
  then free text until the format's trigger, and the call after it constrained.

Each call's envelope (the tags and the function name) is always enforced. The arguments of a forced call
(required / named) always follow the function's `parameters` schema (an empty object when it has none): a
forced call parses and validates, strict or not. Under "auto" they follow it only for strict tools
(`"strict": true`, or `--tool-strict-level parameter`), else they are any JSON value (vLLM's
resolve_tool_strictness). A request's own
response_format / structured_outputs is replaced under required / named (vLLM logs that it is
ignored) and, under a constrained "auto", allowed as the alternative to calling.

Formats: "hermes" (built here, as vLLM's registry builds it) and any of xgrammar's builtins ("llama" for
llama3_json, "qwen_3_coder" for qwen3_coder, or whichever a plugin parser names), built by the function vLLM
calls. A parser without a structural tag (pythonic, phi4_mini_json) gets vLLM's JSON forms under required /
named (`_json_forms`, tokenloom/server/tool_parsers/json_calls.py) and nothing under auto; so does a server
without --tool-call-parser (vLLM: named and required need no parser, "auto" does).
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.errors import APIError
from tokenloom.server.tool_parsers import get_tool_parser
from tokenloom.server.tool_parsers.json_calls import json_schema_from_tools, params_or_empty_object
from tokenloom.server.tools import ToolSetup

STRICT_LEVELS = ("auto", "function", "parameter")  # vLLM's ToolStrictLevel, weakest first
# A forced call's (required / named) arguments allow at most this many whitespace characters in a row
# (xgrammar's JSONSchemaFormat.max_whitespace_cnt). JSON's grammar allows any amount between tokens, and a
# small model can write newlines inside `{}` until max_tokens (SmolLM2 did, under the JSON forms below); a
# forced call must end. 8 keeps one-line calls and two levels of pretty-printing (a newline and up to seven
# spaces) as the model writes them. vLLM 0.32 sets no cap (an addition, as the compact JSON forms are).
FORCED_CALL_MAX_WHITESPACE = 8


def _hermes_tags(tools: dict[str, dict[str, Any]], strict: dict[str, bool],
                 max_whitespace: int | None = None) -> list[dict[str, Any]]:
    # Both spellings the Hermes template produces: the block on its own lines, or inline.
    forms = [('<tool_call>\n{"name": "', "}\n</tool_call>"), ('<tool_call>{"name": "', "}</tool_call>")]
    tags = []
    for name, fn in tools.items():
        params: Any = True  # any JSON value
        if strict[name]:
            params = params_or_empty_object(fn.get("parameters"))
        content: dict[str, Any] = {"type": "json_schema", "json_schema": params}
        if max_whitespace is not None:
            content["max_whitespace_cnt"] = max_whitespace
        for begin, end in forms:
            tags.append({"type": "tag", "begin": f'{begin}{name}", "arguments": ', "content": content, "end": end})
    return tags


def _output_format(so: StructuredOutputsParams) -> dict[str, Any] | None:
    """A request's own constraint as a structural-tag format (vLLM: structured_outputs_to_format)."""
    if so.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        return {"type": "json_schema", "json_schema": schema}
    if so.regex is not None:
        return {"type": "regex", "pattern": so.regex}
    if so.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in so.choice]}
    if so.grammar is not None:
        return {"type": "grammar", "grammar": so.grammar}
    if so.structural_tag is not None:
        tag = json.loads(so.structural_tag)
        return tag.get("format") if "structures" not in tag else None
    return None


def _builtin_format(model: str, tools: ToolSetup, strict: dict[str, bool], choice: str,
                    max_whitespace: int | None = None) -> dict[str, Any]:
    """xgrammar's builtin tag of a model family (vLLM calls the same function): for "llama", `{"name":
    "<tool>", "parameters": ...}` objects triggered by `{"name": `; for "qwen_3_coder", `<tool_call>
    <function=...>` blocks with XML parameters. One call of the named function when it is forced."""
    import xgrammar as xgr

    dumped = []
    for name, fn in tools.tools.items():
        function = {k: fn[k] for k in ("description", "parameters") if fn.get(k) is not None}
        dumped.append({"type": "function", "function": {"name": name, **function, "strict": strict[name]}})
    tool_choice: Any = choice
    if choice == "forced":
        tool_choice = {"type": "function", "function": {"name": tools.named}}
    try:
        tag = xgr.get_model_structural_tag(model=model, tools=dumped, tool_choice=tool_choice, reasoning=False,
                                           max_whitespace_cnt=max_whitespace)
    except ValueError as exc:  # a plugin parser naming a format this xgrammar does not have
        raise APIError(400, f"tools: the structural tag {model!r} of --tool-call-parser {tools.parser}: {exc}",
                       "tools") from None
    return tag.model_dump()["format"]


_CALL_LISTS = ("triggered_tags", "token_triggered_tags", "tags_with_separator")


def _limit_to_single_call(node: Any) -> None:
    """vLLM's limit_to_single_tool_call: every list of calls stops after its first (in place)."""
    if isinstance(node, dict):
        if node.get("type") in _CALL_LISTS:
            node["stop_after_first"] = True
        for value in node.values():
            _limit_to_single_call(value)
    elif isinstance(node, list):
        for item in node:
            _limit_to_single_call(item)


def _json_forms(tools: ToolSetup, requested: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """vLLM's ToolParser.adjust_request for a parser without a structural tag: required / named are
    forced with a JSON schema (json_calls.py), replacing the request's own format unless that is a
    structural tag; auto is left free.

    Unlike vLLM, the JSON is compact (disable_any_whitespace): with JSON's "any whitespace" a small model
    can write newlines inside `{}` until max_tokens (SmolLM2 did, for a function without parameters),
    and a forced call must always parse."""
    if requested is not None and requested.structural_tag is not None:
        return requested
    try:
        schema = json_schema_from_tools(tools.tools, tools.mode, tools.named, tools.parallel_tool_calls)
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from None
    return requested if schema is None else StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# Constraints a user asked for that a parser's forced-call schema does not replace (vLLM's Mistral
# adjust_request keeps a request's own structured_outputs; it replaces only a json response_format).
_KEPT_OVER_FORCED_SCHEMA = ("regex", "choice", "grammar", "structural_tag")


def _parser_forced_schema(schema: dict[str, Any],
                          requested: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """A parser's own schema for forced calls (mistral's pre-v11 array), in place of a JSON format the
    request asked for; a regex / choice / grammar / structural tag of the request's stays instead. Compact
    JSON, as `_json_forms`: a forced call must end."""
    if requested is not None and any(getattr(requested, f, None) is not None for f in _KEPT_OVER_FORCED_SCHEMA):
        return requested
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def tool_structured_outputs(tools: ToolSetup, requested: StructuredOutputsParams | None,
                            strict_level: str = "auto") -> StructuredOutputsParams | None:
    """The request's constraint once its tools are taken into account (`requested` when they add none)."""
    if tools.mode == "none" or tools.choice_null:
        return requested
    if tools.parser is None:  # vLLM without a parser: required / named by JSON schema, "auto" is refused earlier
        return _json_forms(tools, requested) if tools.mode in ("required", "named") else requested
    parser = get_tool_parser(tools.parser)
    model = parser.structural_tag_model
    if model is None and tools.mode in ("required", "named") and tools.tools \
            and (schema := parser.forced_calls_schema(tools.tools, tools.named)) is not None:
        return _parser_forced_schema(schema, requested)
    if model is None:
        return _json_forms(tools, requested)
    level = STRICT_LEVELS.index(strict_level)
    single_call = not tools.parallel_tool_calls
    if single_call and not (tools.mode == "auto" and requested is not None):
        level = max(level, STRICT_LEVELS.index("function"))  # the call count needs the envelope
    chosen = {tools.named: tools.tools[tools.named]} if tools.mode == "named" and tools.named else tools.tools
    # A forced call (required / named) always holds its arguments to the tool's parameters: the call must
    # parse and validate (issue 35: a non-strict named get_weather(city) wrote the schema back as
    # arguments, {"city": {"type": "string", ...}}). Under "auto" the strictness rules above decide.
    forced = tools.mode in ("required", "named")
    strict = {name: forced or level >= STRICT_LEVELS.index("parameter") or fn.get("strict") is True
              for name, fn in tools.tools.items()}
    if tools.mode == "auto" and level == 0 and not any(strict.values()):
        return requested  # vLLM: no structural tag, the model writes freely
    extra = _output_format(requested) if tools.mode == "auto" and requested is not None else None
    if tools.mode == "auto" and extra is None and requested is not None:
        return requested  # vLLM: a constraint it cannot combine wins over the tools
    # vLLM builds "auto" with a response format as "required", so the format stays the alternative.
    choice = {"auto": "auto" if extra is None else "required", "required": "required",
              "named": "forced"}[tools.mode]
    max_whitespace = FORCED_CALL_MAX_WHITESPACE if forced else None
    fmt: dict[str, Any]
    if model != "hermes":
        fmt = _builtin_format(model, tools, strict, choice, max_whitespace)
    else:
        tags = _hermes_tags(chosen, strict, max_whitespace)
        if choice == "auto":
            fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "at_least_one": False,
                   "stop_after_first": False}
        else:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
                   "stop_after_first": choice == "forced"}
    if single_call:
        _limit_to_single_call(fmt)
    if extra is not None:
        fmt = {"type": "or", "elements": [fmt, extra]}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))
