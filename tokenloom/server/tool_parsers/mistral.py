"""Mistral tool calls (`--tool-call-parser mistral`) for a Hugging Face tokenizer, as vLLM 0.32 reads them
(vLLM: tool_parsers/mistral_tool_parser.py, parser/mistral.py `MistralParser`).

Which format the model writes is vLLM's `_is_pre_v11_tokeniser` rule for a tokenizer that is not
mistral-common's: a vocabulary without `[ARGS]` is pre-v11.

- pre-v11 (e.g. Mistral-7B-Instruct-v0.3): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a bare
  object is one call). Whole: the first JSON value after the marker (vLLM's raw_decode, then its `[{.*}]`
  regex), entries that are not call objects skipped, a missing name "", string arguments kept as they are,
  others json.dumps'd; text after the value is dropped; JSON holding no call leaves it as content.
  Streaming: the calls in order, each announced with its name once known, then its arguments as the model
  wrote them; text after the value is content.
- v11+ (`[ARGS]` in the vocabulary): `[TOOL_CALLS]name[ARGS]{...}` or `[TOOL_CALLS]name{...}`, one marker per
  call. The name is final at `[ARGS]` / `{` (empty when the model wrote it before the marker), the arguments
  are the first JSON value after it (text after it is dropped; unparsable arguments are kept as written;
  none: "{}").

Text before the first marker is content (None when only whitespace). Call ids are Mistral's: 9 letters or
digits (`MistralToolCall`). tool_choice "required" / a named function: vLLM forces them with a JSON schema of
the pre-v11 array (`forced_calls_schema`) and reads the bare array this parser gets back; so does tokenloom,
for both formats (vLLM reads a v11 tokenizer's forced array with its v11 engine, which finds no marker and
returns the calls as content; tokenloom reads it as the calls it is).

A vocabulary without `[TOOL_CALLS]` is refused at start-up with vLLM's message. mistral-common's tokenizer
(vLLM's `--tokenizer-mode mistral`, its grammar-driven tool choice and `[THINK]` reasoning) is not
implemented: tokenloom loads Hugging Face tokenizers only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from random import choices
from string import ascii_letters, digits
from typing import Any

from tokenloom.server.tool_parsers.base import ToolParser, partial_tag_overlap
from tokenloom.server.tool_parsers.messages import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)

logger = logging.getLogger(__name__)

TOOL_CALLS_TOKEN = "[TOOL_CALLS]"
ARGS_TOKEN = "[ARGS]"
_ALPHANUMERIC = ascii_letters + digits
_ARRAY_OF_CALLS = re.compile(r"\[{.*}\]", re.DOTALL)  # vLLM's fallback when the JSON does not start clean


def make_mistral_tool_call_id() -> str:
    """Mistral's tool call ids are 9 letters or digits (mistral-common's validator refuses others)."""
    return "".join(choices(_ALPHANUMERIC, k=9))


def is_valid_mistral_tool_call_id(call_id: str) -> bool:
    return call_id.isalnum() and len(call_id) == 9


def is_pre_v11_tokenizer(tokenizer: Any) -> bool:
    """vLLM's rule for a tokenizer that is not mistral-common's: no `[ARGS]` token, the pre-v11 format."""
    vocab = getattr(tokenizer, "get_vocab", lambda: {})()
    return ARGS_TOKEN not in vocab


def is_forced_choice(request: Any) -> bool:
    """tool_choice "required" or a named function, as a request object or its JSON."""
    choice = request.get("tool_choice") if isinstance(request, dict) else getattr(request, "tool_choice", None)
    if choice == "required":
        return True
    if isinstance(choice, dict):
        return isinstance(choice.get("function"), dict)
    return getattr(choice, "function", None) is not None


def _tool_choice(request: Any) -> Any:
    return request.get("tool_choice") if isinstance(request, dict) else getattr(request, "tool_choice", None)


def _has_tools(request: Any) -> bool:
    return bool(request.get("tools") if isinstance(request, dict) else getattr(request, "tools", None))


def pre_v11_function_calls(parsed: Any) -> list[FunctionCall]:
    """The calls in the JSON after a pre-v11 marker: a bare object is one call, entries that are not call
    objects are skipped, a missing or non-string name is "", string arguments are kept as written."""
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    calls: list[FunctionCall] = []
    for entry in parsed:
        if not isinstance(entry, dict) or not ("name" in entry or "arguments" in entry):
            continue
        name = entry.get("name")
        arguments = entry.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(FunctionCall(name=name if isinstance(name, str) else "", arguments=arguments))
    return calls


def _decode_pre_v11_calls(text: str) -> Any:
    """The first JSON value of `text` (trailing output ignored), else the `[{...}]` the regex finds, else None."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except json.JSONDecodeError:
        pass
    found = _ARRAY_OF_CALLS.findall(text)
    if not found:
        return None
    try:
        return json.loads(found[0])
    except json.JSONDecodeError:
        return None


def first_json_value(raw_args: str) -> str:
    """v11 arguments: the first complete JSON value as written (text after it dropped, gh#48975), the text
    as written when it does not parse, "{}" when there is none."""
    stripped = raw_args.strip()
    if not stripped:
        return "{}"
    try:
        _, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError:
        return stripped
    return stripped[:end]


def _split_v11_call(segment: str) -> tuple[str, str | None]:
    """(name, argument text or None while no separator came) of the text after one `[TOOL_CALLS]`."""
    at_args, at_brace = segment.find(ARGS_TOKEN), segment.find("{")
    if at_args != -1 and (at_brace == -1 or at_args < at_brace):
        return segment[:at_args].strip(), segment[at_args + len(ARGS_TOKEN):]
    if at_brace != -1:
        return segment[:at_brace].strip(), segment[at_brace:]
    return segment.strip(), None


def _content_or_none(content: str) -> str | None:
    return content if content.strip() else None


# Streaming the pre-v11 JSON ------------------------------------------------------------------------------
@dataclass
class _ScannedCall:
    name: str | None = None  # complete names only
    args_start: int | None = None  # where an object / array value of "arguments" starts
    args_end: int | None = None  # one past its end, once closed
    string_args: str | None = None  # a string value of "arguments", once complete
    closed: bool = False


def _string_end(text: str, start: int) -> int | None:
    """One past the closing quote of the JSON string opening at `start`, None while it is incomplete."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def scan_pre_v11(text: str) -> tuple[list[_ScannedCall], int | None]:
    """The calls of the (possibly partial) JSON `text` (an array of calls or one bare call object) and where
    the top-level value ends (None while it is open). Loose: only what streaming needs is tracked."""
    calls: list[_ScannedCall] = []
    if not text or text[0] not in "[{":
        return calls, None
    item_depth = 2 if text[0] == "[" else 1
    stack: list[str] = []
    key: str | None = None
    expect_key = False
    i = 0
    while i < len(text):
        c = text[i]
        at_item = len(stack) == item_depth and stack[-1] == "{"
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                break
            if at_item:
                value = json.loads(text[i:end])
                if expect_key:
                    key = value
                elif key == "name" and isinstance(value, str):
                    calls[-1].name = value
                elif key == "arguments":
                    calls[-1].string_args = value
            i = end
            continue
        if c in "[{":
            if at_item and not expect_key and key == "arguments":
                calls[-1].args_start = i
            stack.append(c)
            if len(stack) == item_depth and c == "{":
                calls.append(_ScannedCall())
                expect_key, key = True, None
        elif c in "]}":
            if not stack:
                break
            stack.pop()
            if len(stack) == item_depth and stack[-1] == "{" and calls and calls[-1].args_start is not None \
                    and calls[-1].args_end is None:
                calls[-1].args_end = i + 1
            if len(stack) == item_depth - 1 and calls and c == "}":
                calls[-1].closed = True
            if not stack:
                return calls, i + 1
        elif at_item and c == ":":
            expect_key = False
        elif at_item and c == ",":
            expect_key, key = True, None
        i += 1
    return calls, None


class MistralToolParser(ToolParser):
    name = "mistral"
    # vLLM: required / named are read by this parser (the forced output is its own array), not the JSON forms.
    supports_required_and_named = False
    keeps_special_tokens = True  # `[TOOL_CALLS]` is a special token: vLLM's adjust_request keeps it in the text
    tools_prompt = """[AVAILABLE_TOOLS] [{tools}][/AVAILABLE_TOOLS]
To call functions, answer [TOOL_CALLS] followed by a JSON array of {{"name": ..., "arguments": {{...}}}} objects."""

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.bot_token = TOOL_CALLS_TOKEN
        self.bot_token_id: int | None = self.vocab.get(TOOL_CALLS_TOKEN)
        if self.bot_token_id is None:
            raise RuntimeError("Mistral parser could not locate the tool call token in the tokenizer!")
        self.is_pre_v11 = is_pre_v11_tokenizer(tokenizer)
        # Streaming state: whether the calls began, how much content went out, each call's id and what of
        # its name / arguments was sent.
        self._calls_started = False
        self._sent_content = 0
        self._call_start = 0  # where the calls' text begins in current_text
        self._ids: list[str] = []
        self._name_sent: list[bool] = []
        self._text = ""
        self._forced = False

    # Forced calls ------------------------------------------------------------------------------------
    @classmethod
    def forced_calls_schema(cls, tools: dict[str, dict[str, Any]], named: str | None) -> dict[str, Any] | None:
        """vLLM's `_build_guided_schema_pre_v11`: a non-empty array of {"name", "arguments"} calls of the
        tools (named: of that one, at most one call); None when the named tool is not among them."""
        chosen = [fn for name, fn in tools.items() if named is None or name == named]
        if not chosen:
            return None
        any_of = [{"type": "object",
                   "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                  "arguments": fn.get("parameters") or {"type": "object"}},
                   "required": ["name", "arguments"]} for fn in chosen]
        extra = {"maxItems": 1} if named is not None else {}
        return {"type": "array", "minItems": 1, **extra, "items": {"type": "object", "anyOf": any_of}}

    # Whole output ------------------------------------------------------------------------------------
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if _tool_choice(request) == "none" and _has_tools(request):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        if self.is_pre_v11 or (self.bot_token not in model_output and is_forced_choice(request)):
            return self._extract_pre_v11(model_output, request)
        return self._extract_v11(model_output)

    def _extract_pre_v11(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        content: str | None = None
        if self.bot_token in model_output:
            # Repeated markers with nothing between them count as one; text after a later marker is dropped.
            content, *segments = model_output.split(self.bot_token)
            calls_text = next((s.strip() for s in segments if s.strip()), "")
        elif is_forced_choice(request):
            calls_text = model_output.strip()  # the forced bare array, no marker
        else:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        parsed = _decode_pre_v11_calls(calls_text)
        calls = pre_v11_function_calls(parsed)
        if not calls:
            logger.debug("no Mistral tool call in %r", calls_text[:80])
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=calls_text)
        return ExtractedToolCallInformation(
            tools_called=True, content=_content_or_none(content or ""),
            tool_calls=[ToolCall(id=make_mistral_tool_call_id(), function=fc) for fc in calls])

    def _extract_v11(self, model_output: str) -> ExtractedToolCallInformation:
        if self.bot_token not in model_output:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        content, *segments = model_output.split(self.bot_token)
        calls = []
        for segment in segments:
            name, raw_args = _split_v11_call(segment)
            arguments = first_json_value(raw_args or "")
            calls.append(ToolCall(id=make_mistral_tool_call_id(), function=FunctionCall(name=name,
                                                                                        arguments=arguments)))
        content = content.strip()
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    # Streaming ---------------------------------------------------------------------------------------
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> DeltaMessage | None:
        self._text = current_text
        self._forced = is_forced_choice(request)
        try:
            return self._stream(current_text, request)
        except Exception:  # vLLM logs and skips the chunk
            logger.debug("Mistral streaming: skipped a chunk", exc_info=True)
            return None

    def _stream(self, text: str, request: Any) -> DeltaMessage | None:
        if not self._calls_started:
            marker = text.find(self.bot_token, self._sent_content)
            if marker != -1:
                self._calls_started, self._call_start = True, marker + len(self.bot_token)
                content = text[self._sent_content:marker]
            elif self._forced and text.strip():
                self._calls_started, self._call_start = True, self._sent_content
                content = ""
            else:  # content until the marker; hold back a tail that may grow into it
                end = len(text) - partial_tag_overlap(text, self.bot_token)
                content = text[self._sent_content:end]
                self._sent_content = max(self._sent_content, end)
                return DeltaMessage(content=content) if content else None
            self._sent_content = self._call_start
            message = self._stream_calls(text)
            if content and (self.is_pre_v11 or content.strip()):
                message = message or DeltaMessage()
                message.content = content
            return message
        return self._stream_calls(text)

    def _stream_calls(self, text: str) -> DeltaMessage | None:
        if self.is_pre_v11 or (self._forced and self.bot_token not in text):
            return self._stream_pre_v11(text[self._call_start:])
        return self._stream_v11(text[self._call_start:], final=False)

    def _announce(self, index: int, name: str) -> DeltaToolCall:
        while len(self._ids) <= index:
            self._ids.append(make_mistral_tool_call_id())
            self._name_sent.append(False)
            self.prev_tool_call_arr.append({})
            self.streamed_args_for_tool.append("")
        self._name_sent[index] = True
        self.prev_tool_call_arr[index]["name"] = name
        self.current_tool_id = index
        return DeltaToolCall(index=index, id=self._ids[index], type="function",
                             function=DeltaFunctionCall(name=name))

    def _send_args(self, index: int, args: str, deltas: list[DeltaToolCall]) -> None:
        sent = self.streamed_args_for_tool[index]
        if len(args) <= len(sent) or not args.startswith(sent):
            return
        self.streamed_args_for_tool[index] = args
        self.prev_tool_call_arr[index]["arguments"] = args
        diff = args[len(sent):]
        if deltas and deltas[-1].index == index and deltas[-1].function is not None \
                and deltas[-1].function.arguments is None:
            deltas[-1].function.arguments = diff
        else:
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=diff)))

    def _stream_pre_v11(self, body: str) -> DeltaMessage | None:
        # Markers repeated before the JSON (Mistral-7B writes them at temperature 0) are skipped.
        lead = re.match(rf"(?:\s|{re.escape(self.bot_token)})*", body)
        offset = lead.end() if lead else 0
        json_text = body[offset:]
        calls, end = scan_pre_v11(json_text)
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(calls):
            if i >= len(self._name_sent) or not self._name_sent[i]:
                if call.name is None and not call.closed:
                    break  # announced with its name; nothing after it can go out first
                deltas.append(self._announce(i, call.name or ""))
            if call.string_args is not None:
                args = call.string_args
            elif call.args_start is not None:
                args = json_text[call.args_start:call.args_end or len(json_text)]
            else:
                continue
            self._send_args(i, args, deltas)
        content = None
        if end is not None:
            trailing_from = self._call_start + offset + end
            if len(self._text) > max(trailing_from, self._sent_content):
                content = self._text[max(trailing_from, self._sent_content):]
                self._sent_content = len(self._text)
        if deltas or content:
            return DeltaMessage(content=content, tool_calls=deltas)
        return None

    def _stream_v11(self, body: str, final: bool) -> DeltaMessage | None:
        deltas: list[DeltaToolCall] = []
        segments = body.split(self.bot_token)
        for i, segment in enumerate(segments):
            name, raw_args = _split_v11_call(segment)
            complete = i < len(segments) - 1 or final
            if raw_args is None and not complete:
                break  # the name may still grow
            if i >= len(self._name_sent) or not self._name_sent[i]:
                deltas.append(self._announce(i, name))
            if raw_args is None:
                if complete:
                    self._send_args(i, "{}", deltas)
                continue
            args = raw_args.lstrip()
            if complete or is_json_value_complete(args):
                args = first_json_value(args)
            self._send_args(i, args, deltas)
        return DeltaMessage(tool_calls=deltas) if deltas else None

    def finish_streaming(self) -> DeltaMessage | None:
        """The end of the stream: a v11 call whose name was not final yet (no arguments) goes out with "{}"."""
        if not self._calls_started or self.is_pre_v11 or self.bot_token not in self._text:
            return None
        return self._stream_v11(self._text[self._call_start:], final=True)


def is_json_value_complete(text: str) -> bool:
    try:
        json.JSONDecoder().raw_decode(text)
        return True
    except json.JSONDecodeError:
        return False

