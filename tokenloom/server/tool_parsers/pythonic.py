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
import logging
from collections.abc import Sequence
from typing import Any

import regex

from tokenloom.server.tool_parsers.base import ToolParser
from tokenloom.server.tool_parsers.messages import DeltaMessage, ExtractedToolCallInformation
from tokenloom.server.tool_parsers.python_calls import (
    UnexpectedAstError,
    compute_tool_delta,
    handle_single_tool,
    make_valid_python,
)

logger = logging.getLogger(__name__)
# vLLM's VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS default: the regex can backtrack badly on odd text.
REGEX_TIMEOUT_S = 1


class PythonicToolParser(ToolParser):
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

    # vLLM's name for what its base class calls current_tool_id: the call being streamed, not an id.
    @property
    def current_tool_index(self) -> int:
        return self.current_tool_id

    @current_tool_index.setter
    def current_tool_index(self, value: int) -> None:
        self.current_tool_id = value

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        not_called = ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        try:
            is_tool_call_pattern = self.TOOL_CALL_REGEX.match(model_output, timeout=REGEX_TIMEOUT_S) is not None
        except TimeoutError:
            logger.warning("Regex timeout occurred when matching tool call pattern.")
            is_tool_call_pattern = False
        if not is_tool_call_pattern:
            return not_called
        try:
            module = ast.parse(model_output)
            parsed = getattr(module.body[0], "value", None)
            if isinstance(parsed, ast.List) and all(isinstance(e, ast.Call) for e in parsed.elts):
                calls = [handle_single_tool(e) for e in parsed.elts]  # type: ignore[arg-type]
                return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)
            raise UnexpectedAstError("Tool output must be a list of function calls")
        except Exception:  # vLLM: logged; the text is content
            logger.debug("no pythonic tool calls in %r", model_output[:80], exc_info=True)
            return not_called

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        if not current_text.startswith("["):
            return DeltaMessage(content=delta_text)
        try:
            return self._stream(current_text)
        except Exception:  # vLLM logs and skips the chunk
            logger.debug("pythonic streaming: skipped a chunk", exc_info=True)
            return None

    def _stream(self, current_text: str) -> DeltaMessage | None:
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
                if delta.function is not None and delta.function.arguments is not None:
                    self.streamed_args_for_tool[index] += delta.function.arguments

        # vLLM: the final-delta completion (get_remaining_unstreamed_args) must add nothing here, and
        # finish_reason must become "tool_calls": a placeholder entry does both.
        if tool_deltas and not self.prev_tool_call_arr:
            self.prev_tool_call_arr = [{"arguments": {}}]
        if tool_deltas:
            return DeltaMessage(tool_calls=tool_deltas)
        if not added_text and self.current_tool_index > 0:
            return DeltaMessage(content="")  # all calls done: an empty delta (finish_reason)
        return None
