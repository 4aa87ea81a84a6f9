"""A Responses request's output items, as JSON (vLLM 0.32's openai types: ResponseOutputMessage,
ResponseReasoningItem, ResponseFunctionToolCall, ResponseCustomToolCall; its build_response_output_items).
The whole response and the stream (serving_responses.py) build their items here, so both carry the same ids
and shapes."""

from __future__ import annotations

import uuid
from typing import Any

from tokenloom.server.responses_tools import ToolNames, decode_custom_tool_input


def new_item_id(prefix: str) -> str:
    """An id with vLLM's prefixes: `resp_`, `msg_`, `rs_`, `fc_` or `ctc_` and a random hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None,
                 ) -> dict[str, Any]:
    """An assistant message with one output_text part (none for no text, as vLLM)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    """vLLM's ResponseReasoningItem: the reasoning as one reasoning_text part (none while it streams in)."""
    content = None if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content, "encrypted_content": None,
            "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str, names: ToolNames | None = None,
              item_id: str | None = None) -> dict[str, Any]:
    """A call as its output item: a custom tool's as a custom_tool_call (id `ctc_...`, its decoded input), any
    other as a function_call (`fc_...`; a namespace's function by its own name and namespace)."""
    names = names or ToolNames()
    if names.is_custom(name):
        return {"id": item_id or new_item_id("ctc"), "type": "custom_tool_call", "call_id": call_id, "name": name,
                "input": decode_custom_tool_input(arguments) if arguments else ""}
    item = {"id": item_id or new_item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if name in names.namespaced:
        item["name"], item["namespace"] = names.namespaced[name]
    return item


def build_response_output_items(reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]],
                                logprobs: list[dict[str, Any]] | None = None, names: ToolNames | None = None,
                                ) -> list[dict[str, Any]]:
    """vLLM's: a reasoning item when the model reasoned, a message when it wrote text, then an item per tool call
    (chat's tool_calls JSON: {"id", "function": {"name", "arguments"}})."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_item_id("rs"), reasoning, None))
    if content:
        items.append(message_item(new_item_id("msg"), content, "completed", logprobs))
    items += [call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed", names)
              for call in tool_calls]
    return items
