"""Llama 3.x / 4 JSON tool calls: `{"name": ..., "parameters": {...}}` objects, optionally after
`<|python_tag|>`, several separated by `; ` (vLLM: tool_parsers/llama_tool_parser.py, same algorithm).

Whole: every top-level `{...}` in the text is decoded (json.JSONDecoder.raw_decode, so nesting and
braces inside strings are handled); each needs "name" and "arguments" or "parameters", re-serialised
with json.dumps. One object that lacks them or does not decode leaves the whole text as content, and
surrounding text is dropped when calls were found (content is None), as vLLM.
Streaming: text that does not start with `<|python_tag|>` or `{` is content, delta by delta; otherwise
the calls are read with partial_json_parser (vLLM's library and flags): a call is announced once its
name is complete, its arguments go out as the common prefix of successive json.dumps of the partial
arguments (never a closing quote or brace too early), the rest once the object is complete.

The parser needs `<|python_tag|>` in the vocabulary: vLLM's constructor raises without it, so the server
refuses `--tool-call-parser llama3_json` at start-up on such a tokenizer (SmolLM2's), with vLLM's words.
Forced calls (tool_choice required / named, strict tools) use xgrammar's builtin "llama" structural tag
(tokenloom/server/tool_grammar.py), read back by this parser.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import partial_json_parser
import regex
from partial_json_parser.core.options import Allow

from tokenloom.server.tool_parsers.base import ToolParser, find_common_prefix, is_complete_json, partial_json_loads
from tokenloom.server.tool_parsers.messages import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

logger = logging.getLogger(__name__)
# vLLM's VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS default.
REGEX_TIMEOUT_S = 1


class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"
    structural_tag_model = "llama"
    tool_call_start_regex = regex.compile(r"\{")
    json_decoder = json.JSONDecoder()
    tools_prompt = (
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\n"
        'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its '
        'value}}. Do not use variables.\n\n{tools}'
    )

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.bot_token_id = self.vocab.get(self.bot_token)
        if self.bot_token_id is None:  # vLLM's constructor error, which refuses the parser at start-up
            raise RuntimeError(f"Llama3JsonToolParser could not locate the bot token '{self.bot_token}' "
                               "in the tokenizer.")

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        not_called = ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        if not (self.bot_token in model_output or "{" in model_output):
            return not_called
        end_index = -1  # the end of the last decoded object: braces inside it are not new calls
        calls: list[ToolCall] = []
        try:
            for match in self.tool_call_start_regex.finditer(model_output, timeout=REGEX_TIMEOUT_S):
                start_index = match.start()
                if start_index <= end_index:
                    continue
                try:
                    obj, json_end_index = self.json_decoder.raw_decode(model_output[start_index:])
                    end_index = start_index + json_end_index
                    args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                    calls.append(ToolCall(function=FunctionCall(
                        name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))))
                except Exception:  # vLLM: a missing key, undecodable JSON, a non-object: all text is content
                    logger.debug("no Llama JSON tool call at %d of %r", start_index, model_output[:80])
                    return not_called
        except TimeoutError:  # vLLM: the regex ran out of time; the text is content
            logger.warning("Regex timeout occurred when matching tool call pattern.")
            return not_called
        if calls:
            return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)
        return not_called

    # Streaming ---------------------------------------------------------------------------------
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        if not (current_text.startswith(self.bot_token) or current_text.startswith("{")):
            return DeltaMessage(content=delta_text)
        # Until the name went out, no partial strings: a name is sent whole (OpenAI's way).
        flags = Allow.ALL if self.current_tool_name_sent else Allow.ALL & ~Allow.STR
        try:
            return self._stream(current_text, flags)
        except Exception:  # vLLM logs and skips the chunk
            logger.debug("Llama JSON streaming: skipped a chunk", exc_info=True)
            return None

    def _parse_calls(self, current_text: str, flags: Allow) -> tuple[list[dict[str, Any]], list[bool]]:
        """Every call object so far (the last possibly partial) and whether each is complete JSON."""
        tool_call_arr: list[dict[str, Any]] = []
        is_complete: list[bool] = []
        # The model may or may not start with <|python_tag|>.
        start_idx = len(self.bot_token) if current_text.startswith(self.bot_token) else 0
        while start_idx < len(current_text):
            obj, end_idx = partial_json_loads(current_text[start_idx:], flags)
            is_complete.append(is_complete_json(current_text[start_idx: start_idx + end_idx]))
            start_idx += end_idx + len("; ")
            # Llama writes "arguments" or "parameters", depending on the prompt.
            if "parameters" in obj:
                assert "arguments" not in obj, "model generated both parameters and arguments"
                obj["arguments"] = obj["parameters"]
            tool_call_arr.append(obj)
        return tool_call_arr, is_complete

    def _stream(self, current_text: str, flags: Allow) -> DeltaMessage | None:
        try:
            tool_call_arr, is_complete = self._parse_calls(current_text, flags)
        except partial_json_parser.core.exceptions.MalformedJSON:
            return None  # not enough text to parse yet
        if not tool_call_arr:
            return None
        current_tool_call: dict[str, Any] = tool_call_arr[self.current_tool_id]
        delta: DeltaMessage | None = None
        if len(tool_call_arr) > self.current_tool_id + 1:
            # A new call begins: first send what JSON completion revealed of the previous one.
            if self.current_tool_id >= 0:
                cur_arguments = current_tool_call.get("arguments")
                if cur_arguments:
                    cur_args_json = json.dumps(cur_arguments, ensure_ascii=False)
                    argument_diff = cur_args_json[len(self.streamed_args_for_tool[self.current_tool_id]):]
                    delta = self._arguments_delta(argument_diff)
                    self.streamed_args_for_tool[self.current_tool_id] += argument_diff
            self.current_tool_id = len(tool_call_arr) - 1
            self.current_tool_name_sent = False
            self.streamed_args_for_tool.append("")
            return delta  # vLLM returns here without updating prev_tool_call_arr
        if not self.current_tool_name_sent:
            function_name = current_tool_call.get("name")
            if function_name:
                delta = DeltaMessage(tool_calls=[DeltaToolCall(
                    index=self.current_tool_id, type="function", id=make_tool_call_id(),
                    function=DeltaFunctionCall(name=function_name))])
                self.current_tool_name_sent = True
        else:
            argument_diff = self._arguments_diff(current_tool_call, is_complete[self.current_tool_id])
            if argument_diff is not None:
                delta = self._arguments_delta(argument_diff)
                self.streamed_args_for_tool[self.current_tool_id] += argument_diff
        self.prev_tool_call_arr = tool_call_arr
        return delta

    def _arguments_diff(self, current_tool_call: dict[str, Any], complete: bool) -> str | None:
        """The current call's arguments text not sent yet: all of it once the call is complete, else what two
        successive renderings agree on (vLLM's rule)."""
        cur_arguments = current_tool_call.get("arguments")
        if not cur_arguments:
            return None
        sent = len(self.streamed_args_for_tool[self.current_tool_id])
        cur_args_json = json.dumps(cur_arguments, ensure_ascii=False)
        if complete:
            return cur_args_json[sent:]
        prev_arguments = self.prev_tool_call_arr[self.current_tool_id].get("arguments")
        if not prev_arguments:
            return None
        prev_args_json = json.dumps(prev_arguments, ensure_ascii=False)
        if cur_args_json == prev_args_json:
            return None
        return find_common_prefix(prev_args_json, cur_args_json)[sent:]

    def _arguments_delta(self, arguments: str) -> DeltaMessage:
        return DeltaMessage(tool_calls=[DeltaToolCall(index=self.current_tool_id,
                                                      function=DeltaFunctionCall(arguments=arguments))])
