"""A streamed Responses output as its events (vLLM 0.32's SimpleStreamingEventProcessor and split_delta,
responses/streaming_events.py): each step's delta is split into pieces of one kind (reasoning, then content,
then each tool call by its index), and each piece goes to the one open output item, opening a new one (and
closing the last) when its kind, or its call, differs:

    reasoning:  output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                content_part.done, output_item.done
    message:    output_item.added, content_part.added, output_text.delta..., output_text.done,
                content_part.done, output_item.done
    call:       output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                output_item.done
    custom call: output_item.added, custom_tool_call_input.delta..., custom_tool_call_input.done,
                output_item.done

Events are JSON without their sequence_number (the writer numbers them). The items they close are the ones the
final response carries (`ItemStream.done`), ids included, as the openai client's stream helper checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.server.responses_output import call_item, message_item, new_item_id, reasoning_item
from tokenloom.server.responses_tools import ToolNames, decode_custom_tool_input, decode_custom_tool_input_prefix
from tokenloom.server.tool_parsers import DeltaMessage, DeltaToolCall
from tokenloom.server.tool_parsers.messages import make_tool_call_id

Event = dict[str, Any]
CALL_TYPES = ("function_call", "custom_tool_call")


def split_delta(delta: DeltaMessage) -> list[DeltaMessage]:
    """vLLM's rule: a delta with several kinds becomes one piece per kind, in the order reasoning, content, tool
    calls (one piece per call index); a delta of one kind (one call) is returned as it is."""
    kinds = (delta.reasoning is not None) + (delta.content is not None) + bool(delta.tool_calls)
    if kinds <= 1 and len({tc.index for tc in delta.tool_calls}) <= 1:
        return [delta]
    pieces = []
    if delta.reasoning is not None:
        pieces.append(DeltaMessage(reasoning=delta.reasoning))
    if delta.content is not None:
        pieces.append(DeltaMessage(content=delta.content))
    by_index: dict[int, list[DeltaToolCall]] = {}
    for tc in delta.tool_calls:
        by_index.setdefault(tc.index, []).append(tc)
    pieces += [DeltaMessage(tool_calls=calls) for calls in by_index.values()]
    return pieces or [delta]


@dataclass
class _OpenItem:
    output_index: int
    item: dict[str, Any]
    call_index: int | None = None  # a call's index among the model's calls (a new index is a new call)
    text: str = ""  # the message's text, the reasoning, or the call's arguments, so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    payload: str = ""  # a custom call's input, as far as its deltas sent it

    @property
    def kind(self) -> str:
        return self.item["type"]


class ItemStream:
    """The output items of one streamed response as their events; at most one item is open at a time."""

    def __init__(self, names: ToolNames | None = None, wants_logprobs: bool = False) -> None:
        self.names = names or ToolNames()
        self.wants_logprobs = wants_logprobs
        self.done: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None

    def feed(self, piece: DeltaMessage, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """One piece of split_delta as events (`logprobs`: the content's, when the client asked for them)."""
        events = []
        if piece.reasoning:
            events += self.reasoning(piece.reasoning)
        if piece.content:
            events += self.text(piece.content, logprobs)
        for tc in piece.tool_calls:
            if tc.function is None:
                continue
            if self._starts_call(tc):
                events += self.call(tc.id or make_tool_call_id(), tc.function.name or "", tc.index)
            events += self.arguments(tc.function.arguments or "")
        return events

    def _starts_call(self, tc: DeltaToolCall) -> bool:
        """vLLM's needs_transition: a call piece while no call is open, or of another index than the open one."""
        return self.open is None or self.open.kind not in CALL_TYPES or self.open.call_index != tc.index

    def _opened(self, item: dict[str, Any], call_index: int | None = None) -> list[Event]:
        events = self.close()
        self.open = _OpenItem(len(self.done), item, call_index)
        events.append({"type": "response.output_item.added", "output_index": self.open.output_index, "item": item})
        return events

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        events = []
        if self.open is None or self.open.kind != "message":
            events += self._opened(message_item(new_item_id("msg"), None, "in_progress"))
            events.append(self._event("response.content_part.added", content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        assert self.open is not None
        self.open.text += delta
        self.open.logprobs += logprobs or []
        events.append(self._event("response.output_text.delta", content_index=0, delta=delta, logprobs=logprobs or []))
        return events

    def reasoning(self, delta: str) -> list[Event]:
        """vLLM's emit_simple_reasoning_open / _delta: a reasoning item opened on its first piece."""
        events = []
        if self.open is None or self.open.kind != "reasoning":
            events += self._opened(reasoning_item(new_item_id("rs"), None, "in_progress"))
            events.append(self._event("response.content_part.added", content_index=0,
                                      part={"text": "", "type": "reasoning_text"}))
        assert self.open is not None
        self.open.text += delta
        events.append(self._event("response.reasoning_text.delta", content_index=0, delta=delta))
        return events

    def call(self, call_id: str, name: str, call_index: int | None = None) -> list[Event]:
        return self._opened(call_item(call_id, name, "", "in_progress", self.names), call_index)

    def arguments(self, delta: str) -> list[Event]:
        if self.open is None or self.open.kind not in CALL_TYPES or not delta:
            return []
        self.open.text += delta
        if self.open.kind == "custom_tool_call":
            return self._custom_input(self.open, decode_custom_tool_input_prefix(self.open.text))
        return [self._event("response.function_call_arguments.delta", delta=delta)]

    def close(self) -> list[Event]:
        """The open item's closing events (none when nothing is open); the item joins `done`."""
        if self.open is None:
            return []
        o = self.open
        if o.kind == "message":
            item = message_item(o.item["id"], o.text, "completed", o.logprobs if self.wants_logprobs else None)
            part = item["content"][0]
            events = [self._event("response.output_text.done", content_index=0, text=o.text, logprobs=part["logprobs"]),
                      self._event("response.content_part.done", content_index=0, part=part)]
        elif o.kind == "reasoning":  # vLLM's emit_simple_reasoning_done
            item = reasoning_item(o.item["id"], o.text, "completed")
            events = [self._event("response.reasoning_text.done", content_index=0, text=o.text),
                      self._event("response.content_part.done", content_index=0, part=item["content"][0])]
        elif o.kind == "custom_tool_call":  # the last correcting delta, then the whole input
            item = {**o.item, "input": decode_custom_tool_input(o.text)}
            events = self._custom_input(o, item["input"])
            events.append(self._event("response.custom_tool_call_input.done", input=item["input"]))
        else:
            item = {**o.item, "arguments": o.text, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", name=item["name"], arguments=o.text)]
        events.append({"type": "response.output_item.done", "output_index": o.output_index, "item": item})
        self.open = None
        self.done.append(item)
        return events

    def _event(self, kind: str, **fields: Any) -> Event:
        """An event of the open item."""
        assert self.open is not None
        return {"type": kind, "item_id": self.open.item["id"], "output_index": self.open.output_index, **fields}

    def _custom_input(self, o: _OpenItem, payload: str) -> list[Event]:
        """vLLM's custom_tool_call_input deltas: what of the input the arguments so far surely hold, beyond what
        was sent; an input that does not extend what was sent (it cannot be taken back) is sent again whole."""
        sent = o.payload
        if payload == sent:
            return []
        o.payload = payload
        delta = payload[len(sent):] if payload.startswith(sent) else payload
        return [self._event("response.custom_tool_call_input.delta", delta=delta)]
