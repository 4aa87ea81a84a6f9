"""The tools of a chat request (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): checked, with
vLLM's 400s, into one ToolSetup that the chat template, the tool grammar (tokenloom/server/tool_grammar.py)
and the tool-call parsers (tokenloom/server/tool_calls.py) read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.server.errors import APIError


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
    # What a parser is built with and given (vLLM's ToolParser(tokenizer, tools), its `request` argument):
    # set by the endpoint that parsed the request.
    tokenizer: Any = None
    request: Any = None

    @property
    def tool_list(self) -> list[dict[str, Any]]:
        """The tools as the request listed them (chat's shape), what a parser is built with."""
        return [{"type": "function", "function": fn} for fn in self.tools.values()]

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read as tool calls: any mode but "none" with a parser; "required" and a
        named function without one too (vLLM: forced calls use structured outputs, no parser needed)."""
        if self.parser is None:
            return self.mode in ("required", "named")
        return self.mode in ("auto", "required", "named")


def tool_setup(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None = None, parser: str | None = None,
               tool_choice_given: bool = True) -> ToolSetup | None:
    """The request's tools; `parser` is the server's tool-call parser (None: --enable-auto-tool-choice
    is off), `tool_choice_given` whether the body had the key at all (absent with tools means "auto")."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
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
        # Absent: "auto", OpenAI's default when tools are given (vLLM's validator sets it; the chat request
        # model does: request_checks.py). An explicit null stays None in vLLM: parsed as "auto" when a parser
        # is on, else plain text. An empty list (which the chat request refuses) counts as no tools.
        tool_choice = "auto" if by_name and (not tool_choice_given or parser is not None) else "none"
        null = tool_choice_given
    else:
        null = False
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, \"none\", "
                                "\"auto\" or \"required\" are supported.", "tool_choice")
        return _check_parser(ToolSetup(tool_choice, by_name, parallel_tool_calls=parallel, parser=parser,
                                       choice_null=null))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in by_name:
        raise APIError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                       "tool_choice")
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
