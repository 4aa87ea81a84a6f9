"""Hermes 2 Pro / Qwen 2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
text before the first block is content (vLLM: tool_parsers/hermes_tool_parser.py, same algorithm).

Whole: every block is parsed as JSON and its "arguments" re-serialised (json.dumps); a block that is
not valid JSON, or lacks "name" / "arguments", leaves the whole text as content.
Streaming: each call re-parses the text so far; content before the first `<tool_call>` goes out as it
comes (holding back a tail that may grow into the tag); a call is announced (index, id, type, name)
as soon as its name is complete, then its arguments go out as raw text in pieces, the closing brace
of the outer object held back until the block is complete. So the streamed arguments are the model's
own text of the arguments value, and the whole response's are its json.dumps: equal as JSON, equal
as text when the model wrote them in json.dumps's spacing (vLLM behaves the same).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from tokenloom.server.tool_parsers.base import ToolParser, is_complete_json, partial_tag_overlap
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

_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    name = "hermes"
    structural_tag_model = "hermes"
    keeps_special_tokens = True  # vLLM's adjust_request: the tags are special tokens in some vocabularies
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    # The Hermes/Qwen 2.5 tools system prompt.
    tools_prompt = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._sent_content_idx = 0  # how much of the text before the first call went out as content

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        try:
            raw = [json.loads(a if a else b) for a, b in self.tool_call_regex.findall(model_output)]
            calls = [ToolCall(function=FunctionCall(name=fc["name"],
                                                    arguments=json.dumps(fc["arguments"], ensure_ascii=False)))
                     for fc in raw]
        except Exception:  # vLLM: undecodable JSON or a missing key leaves the whole text as content
            logger.debug("no Hermes tool call in %r", model_output[:80])
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    # Streaming ---------------------------------------------------------------------------------
    def _extract_content(self, current_text: str) -> str | None:
        if self.tool_call_start_token not in current_text:
            sendable = len(current_text) - partial_tag_overlap(current_text, self.tool_call_start_token)
        else:
            sendable = current_text.index(self.tool_call_start_token)
        if sendable > self._sent_content_idx:
            content = current_text[self._sent_content_idx: sendable]
            self._sent_content_idx = sendable
            return content
        return None

    def _extract_tool_call_jsons(self, text: str) -> list[tuple[str, bool]]:
        """(json text, complete) of each <tool_call> region so far."""
        results: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(self.tool_call_start_token, pos)) != -1:
            json_start = start + len(self.tool_call_start_token)
            json_end = text.find(self.tool_call_end_token, json_start)
            if json_end != -1:
                results.append((text[json_start:json_end].strip(), True))
                pos = json_end + len(self.tool_call_end_token)
                continue
            raw = text[json_start:]
            overlap = partial_tag_overlap(raw, self.tool_call_end_token)
            if overlap:
                raw = raw[:-overlap]
            body = raw.strip()
            # Valid JSON without the closing tag: the body is complete, the tag is still to come.
            results.append((body, is_complete_json(body) if body else False))
            break
        return results

    @staticmethod
    def _extract_tool_args(tc_json: str, is_complete: bool) -> str | None:
        match = _ARGS.search(tc_json)
        if not match:
            return None
        raw = tc_json[match.end():]
        if is_complete:  # drop the brace that closes the outer {"name", "arguments"} object
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def _compute_args_diff(self, index: int, tc_json: str, is_complete: bool) -> str | None:
        args = self._extract_tool_args(tc_json, is_complete)
        if args is None or len(args) <= len(self.streamed_args_for_tool[index]):
            return None
        diff = args[len(self.streamed_args_for_tool[index]):]
        self.streamed_args_for_tool[index] = args
        self.prev_tool_call_arr[index]["arguments"] = args
        return diff

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        try:
            return self._stream(current_text)
        except Exception:  # vLLM logs and skips the chunk
            logger.debug("Hermes streaming: skipped a chunk", exc_info=True)
            return None

    def _stream(self, current_text: str) -> DeltaMessage | None:
        content = self._extract_content(current_text)
        deltas: list[DeltaToolCall] = []
        for i, (tc_json, is_complete) in enumerate(self._extract_tool_call_jsons(current_text)):
            if i >= len(self.prev_tool_call_arr):
                self.prev_tool_call_arr.append({})
                self.streamed_args_for_tool.append("")
            if "name" not in self.prev_tool_call_arr[i]:
                match = _NAME.search(tc_json)
                if not match:
                    break  # call i is not announced yet: nothing after it can be
                self.prev_tool_call_arr[i]["name"] = match.group(1)
                deltas.append(DeltaToolCall(index=i, type="function", id=make_tool_call_id(),
                                            function=DeltaFunctionCall(name=match.group(1))))
            diff = self._compute_args_diff(i, tc_json, is_complete)
            if diff:
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=diff)))
        if content or deltas:
            return DeltaMessage(content=content, tool_calls=deltas)
        return None
