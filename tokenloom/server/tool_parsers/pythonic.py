"""Pythonic tool calls (Llama 3.2 / 4, ToolACE): the whole output is a Python list of calls,
`[get_weather(city='Paris', unit='celsius'), get_time(tz='CET')]` (vLLM: tool_parsers/
pythonic_tool_parser.py, same algorithm). Text only: it needs no special token.

Whole: the output must match vLLM's TOOL_CALL_REGEX from its start and parse (ast) as a list of calls
with literal keyword arguments; then every element is a call (arguments: json.dumps of the keywords)
and content is None. Anything else, including text before the list, is content.
Streaming: output that does not start with `[` is content; otherwise the text so far is closed
(brackets, quotes) into valid Python, parsed, and each call's JSON arguments streamed without what the
closing added, so nothing is sent that a later token could contradict.

vLLM gives this parser no structural tag: tool_choice "required" and a named function are forced with
its JSON forms instead (tokenloom/server/tool_parsers/json_calls.py), and never read by this parser.
"""

from __future__ import annotations

import ast
from typing import Any

import regex

from tokenloom.server.tool_parsers.base import ExtractedToolCalls, ToolParser
from tokenloom.server.tool_parsers.python_calls import (
    UnexpectedAstError,
    compute_tool_delta,
    handle_single_tool,
    make_valid_python,
)

# vLLM's VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS default: the regex can backtrack badly on odd text.
REGEX_TIMEOUT_S = 1


class PythonicToolParser(ToolParser):
    name = "pythonic"
    keeps_special_tokens = False
    TOOL_CALL_REGEX = regex.compile(
        r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]",
        regex.DOTALL,
    )
    # Llama 3.2's pythonic tool prompt.
    tools_prompt = (
        "You are an expert in composing functions. You are given a question and a set of possible "
        "functions. Based on the question, you will need to make one or more function/tool calls to "
        "achieve the purpose. If none of the functions can be used, point it out. If the given question "
        "lacks the parameters required by the function, also point it out.\n\n"
        "If you decide to invoke any of the function(s), you MUST put it in the format of "
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
        "You SHOULD NOT include any other text in the response if you call a function.\n\n"
        "Here is a list of functions in JSON format that you can invoke.\n{tools}"
    )

    def __init__(self) -> None:
        super().__init__()
        self.current_tool_index = -1  # vLLM's current_tool_id: the call being streamed, not an id

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        try:
            is_tool_call_pattern = self.TOOL_CALL_REGEX.match(model_output, timeout=REGEX_TIMEOUT_S) is not None
        except TimeoutError:
            is_tool_call_pattern = False
        if not is_tool_call_pattern:
            return ExtractedToolCalls(False, [], model_output)
        try:
            module = ast.parse(model_output)
            parsed = getattr(module.body[0], "value", None)
            if isinstance(parsed, ast.List) and all(isinstance(e, ast.Call) for e in parsed.elts):
                return ExtractedToolCalls(True, [handle_single_tool(e) for e in parsed.elts], None)  # type: ignore[arg-type]
            raise UnexpectedAstError("Tool output must be a list of function calls")
        except Exception:  # vLLM: logged; the text is content
            return ExtractedToolCalls(False, [], model_output)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> dict[str, Any] | None:
        if not current_text.startswith("["):
            return {"content": delta_text, "tool_calls": []}
        try:
            return self._stream(current_text)
        except Exception:  # vLLM logs and skips the chunk
            return None

    def _stream(self, current_text: str) -> dict[str, Any] | None:
        valid = make_valid_python(current_text)
        if valid is None:
            return None
        valid_text, added_text = valid
        module = ast.parse(valid_text)
        parsed = getattr(module.body[0], "value", None)
        if not isinstance(parsed, ast.List) or not all(isinstance(e, ast.Call) for e in parsed.elts):
            raise UnexpectedAstError("Tool output must be a list of function calls")
        tool_calls = [handle_single_tool(e) for e in parsed.elts]  # type: ignore[arg-type]

        tool_deltas = []
        for index, new_call in enumerate(tool_calls):
            if index < self.current_tool_index:
                continue
            self.current_tool_index = index
            if len(self.streamed_args_for_tool) == index:
                self.streamed_args_for_tool.append("")
            new_call_complete = index < len(tool_calls) - 1 or ")]" not in added_text
            if new_call_complete:
                self.current_tool_index += 1
            withheld_suffix = added_text[:-2] if not new_call_complete else ""
            if not new_call_complete and added_text[-2] == ")":
                withheld_suffix = withheld_suffix + "}"  # the call is open: its arguments object too
            # The model's strings are single-quoted; the JSON arguments double-quote them.
            withheld_suffix = withheld_suffix.replace("'", '"')
            delta = compute_tool_delta(self.streamed_args_for_tool[index], new_call, index, withheld_suffix)
            if delta is not None:
                tool_deltas.append(delta)
                self.streamed_args_for_tool[index] += delta["function"].get("arguments") or ""

        # vLLM: the final-delta completion (get_remaining_unstreamed_args) must add nothing here, and
        # finish_reason must become "tool_calls": a placeholder entry does both.
        if tool_deltas and not self.prev_tool_call_arr:
            self.prev_tool_call_arr = [{"arguments": {}}]
        if tool_deltas:
            return {"content": None, "tool_calls": tool_deltas}
        if not added_text and self.current_tool_index > 0:
            return {"content": "", "tool_calls": []}  # all calls done: an empty delta (finish_reason)
        return None
