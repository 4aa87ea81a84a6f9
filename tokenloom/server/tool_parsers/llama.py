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
import re
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

from tokenloom.server.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    find_common_prefix,
    is_complete_json,
    make_call,
    make_tool_call_id,
    partial_json_loads,
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    bot_token = "<|python_tag|>"
    structural_tag_model = "llama"
    keeps_special_tokens = False  # vLLM's llama parser leaves skip_special_tokens alone
    tool_call_start_regex = re.compile(r"\{")
    json_decoder = json.JSONDecoder()
    tools_prompt = (
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\n"
        'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its '
        'value}}. Do not use variables.\n\n{tools}'
    )

    @classmethod
    def check_vocab(cls, vocab: dict[str, int]) -> None:
        if vocab.get(cls.bot_token) is None:
            raise RuntimeError(f"Llama3JsonToolParser could not locate the bot token '{cls.bot_token}' "
                               "in the tokenizer.")

    def __init__(self) -> None:
        super().__init__()
        self.current_tool_id = -1
        self.current_tool_name_sent = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if not (self.bot_token in model_output or "{" in model_output):
            return ExtractedToolCalls(False, [], model_output)
        end_index = -1  # the end of the last decoded object: braces inside it are not new calls
        calls: list[dict[str, Any]] = []
        for match in self.tool_call_start_regex.finditer(model_output):
            start_index = match.start()
            if start_index <= end_index:
                continue
            try:
                obj, json_end_index = self.json_decoder.raw_decode(model_output[start_index:])
                end_index = start_index + json_end_index
                name = obj["name"]
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                if not isinstance(name, str):  # vLLM's FunctionCall(name=...) rejects it
                    raise TypeError("the function name must be a string")
                calls.append(make_call(name, json.dumps(args, ensure_ascii=False)))
            except Exception:  # vLLM: a missing key, undecodable JSON, a non-object: all text is content
                return ExtractedToolCalls(False, [], model_output)
        if calls:
            return ExtractedToolCalls(True, calls, None)
        return ExtractedToolCalls(False, [], model_output)

    # Streaming ---------------------------------------------------------------------------------
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> dict[str, Any] | None:
        if not (current_text.startswith(self.bot_token) or current_text.startswith("{")):
            return {"content": delta_text, "tool_calls": []}
        # Until the name went out, no partial strings: a name is sent whole (OpenAI's way).
        flags = Allow.ALL if self.current_tool_name_sent else Allow.ALL & ~Allow.STR
        try:
            return self._stream(current_text, flags)
        except Exception:  # vLLM logs and skips the chunk
            return None

    def _stream(self, current_text: str, flags: Allow) -> dict[str, Any] | None:
        tool_call_arr: list[dict[str, Any]] = []
        is_complete: list[bool] = []
        try:
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
        except partial_json_parser.core.exceptions.MalformedJSON:
            return None  # not enough text to parse yet

        current_tool_call: dict[str, Any] = tool_call_arr[self.current_tool_id] if tool_call_arr else {}
        delta: dict[str, Any] | None = None
        if not tool_call_arr:
            return None
        if len(tool_call_arr) > self.current_tool_id + 1:
            # A new call begins: first send what JSON completion revealed of the previous one.
            if self.current_tool_id >= 0:
                cur_arguments = current_tool_call.get("arguments")
                if cur_arguments:
                    cur_args_json = json.dumps(cur_arguments, ensure_ascii=False)
                    sent = len(self.streamed_args_for_tool[self.current_tool_id])
                    argument_diff = cur_args_json[sent:]
                    delta = {"content": None, "tool_calls": [
                        {"index": self.current_tool_id, "function": {"arguments": argument_diff}}]}
                    self.streamed_args_for_tool[self.current_tool_id] += argument_diff
            self.current_tool_id = len(tool_call_arr) - 1
            self.current_tool_name_sent = False
            self.streamed_args_for_tool.append("")
            return delta  # vLLM returns here without updating prev_tool_call_arr
        if not self.current_tool_name_sent:
            function_name = current_tool_call.get("name")
            if function_name:
                delta = {"content": None, "tool_calls": [
                    {"index": self.current_tool_id, "type": "function", "id": make_tool_call_id(),
                     "function": {"name": function_name}}]}
                self.current_tool_name_sent = True
        else:
            cur_arguments = current_tool_call.get("arguments")
            if cur_arguments:
                sent = len(self.streamed_args_for_tool[self.current_tool_id])
                cur_args_json = json.dumps(cur_arguments, ensure_ascii=False)
                prev_arguments = self.prev_tool_call_arr[self.current_tool_id].get("arguments")
                argument_diff = None
                if is_complete[self.current_tool_id]:
                    argument_diff = cur_args_json[sent:]
                elif prev_arguments:
                    prev_args_json = json.dumps(prev_arguments, ensure_ascii=False)
                    if cur_args_json != prev_args_json:
                        argument_diff = find_common_prefix(prev_args_json, cur_args_json)[sent:]
                if argument_diff is not None:
                    delta = {"content": None, "tool_calls": [
                        {"index": self.current_tool_id, "function": {"arguments": argument_diff}}]}
                    self.streamed_args_for_tool[self.current_tool_id] += argument_diff
        self.prev_tool_call_arr = tool_call_arr
        return delta
