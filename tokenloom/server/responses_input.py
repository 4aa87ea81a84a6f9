"""A Responses request's input → the chat messages it means, by vLLM 0.32's rules (its responses/utils.py:
construct_input_messages, construct_chat_messages_with_tool_call, _construct_message_from_response_item,
should_continue_final_message), with the items taken as the JSON a client sends.

vLLM's merging, which decides what the chat template sees:
- the assistant side of a turn spans several items: a reasoning item, a message and function calls in a row
  make one assistant message (`reasoning`, `content`, `tool_calls`), each filling what the message before it
  lacks; a second message or a second reasoning item starts a new one, and a tool output ends the turn;
- an assistant message's text is its first content part's (vLLM reads `content[0].text`);
- a reasoning item's text is its first content part's, else its first summary's (with a warning);
  encrypted content is refused;
- user, system and developer messages pass as they are (their text parts joined, as chat joins them).

Each item's shape is checked here too: a malformed one is a 400 naming `input.N` (vLLM's pydantic types
refuse the same items), an item type no chat message can carry is vLLM's "Unsupported input item type".
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tokenloom.server.errors import APIError
from tokenloom.server.request_checks import flat_tool_name

logger = logging.getLogger(__name__)

Message = dict[str, Any]
PARTIAL_STATUSES = ("in_progress", "incomplete")
# vLLM's CUSTOM_TOOL_INPUT_KEY: a custom tool is shown to the model as a function of one string argument.
CUSTOM_TOOL_INPUT_KEY = "input"
_TEXT_KEYS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def should_continue_final_message(request_input: str | list[Any]) -> bool:
    """vLLM's rule: a last message or reasoning item with status in_progress / incomplete is a partial turn the
    model goes on with (continue_final_message, no new generation prompt)."""
    if isinstance(request_input, str) or not request_input or not isinstance(request_input[-1], dict):
        return False
    last = request_input[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in PARTIAL_STATUSES


def construct_input_messages(*, request_instructions: str | None, request_input: str | list[Any],
                             prev_msg: list[Message] | None = None) -> list[Message]:
    """The instructions (a system message), the previous conversation without its system messages (OpenAI:
    instructions do not carry over), then the input."""
    messages: list[Message] = []
    if request_instructions:
        messages.append({"role": "system", "content": request_instructions})
    if prev_msg is not None:
        messages += [dict(m) for m in prev_msg if m.get("role") != "system"]
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
    else:
        messages += construct_chat_messages_with_tool_call(request_input)
    return messages


def construct_chat_messages_with_tool_call(items: list[Any]) -> list[Message]:
    """Input (or output) items → chat messages; some messages span several items (reasoning + tool calls)."""
    messages: list[Message] = []
    for i, item in enumerate(items):
        message = message_from_item(item, messages[-1] if messages else None, f"input.{i}")
        if message is not None:
            messages.append(message)
    return messages


def message_from_item(item: Any, prev_msg: Message | None = None, where: str = "input") -> Message | None:
    """A new chat message for `item`, or None when it joined `prev_msg` (an assistant message it completes)."""
    if not isinstance(item, dict):
        raise APIError(400, f"{where} must be an object", "input")
    prev_assistant = prev_msg if prev_msg is not None and prev_msg.get("role") == "assistant" else None
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):
        return _tool_call_message(_tool_call(item, where), prev_assistant)
    if kind == "reasoning":
        return _reasoning_message(_reasoning_text(item, where), prev_assistant)
    if kind in ("function_call_output", "custom_tool_call_output"):
        return _tool_output_message(item, where)
    if kind == "message":
        return _message(item, where, prev_assistant)
    raise APIError(400, f"Unsupported input item type: {kind}", "input")


# Items ----------------------------------------------------------------------------------------------
def _string_fields(item: dict[str, Any], where: str, names: tuple[str, ...]) -> list[str]:
    values = [item.get(name) for name in names]
    if not all(isinstance(v, str) for v in values):
        raise APIError(400, f"{where}: a {item.get('type')} item needs {', '.join(names)} (strings)", "input")
    return values


def encode_custom_tool_input(payload: str) -> str:
    """A custom tool's free text as the arguments of the function the model was shown (vLLM's shim)."""
    return json.dumps({CUSTOM_TOOL_INPUT_KEY: payload}, ensure_ascii=False)


def _tool_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function_call (a namespace's function by its flat name again) or custom_tool_call item as a chat
    tool call."""
    if item["type"] == "custom_tool_call":
        call_id, name, payload = _string_fields(item, where, ("call_id", "name", "input"))
        arguments = encode_custom_tool_input(payload)
    else:
        call_id, name, arguments = _string_fields(item, where, ("call_id", "name", "arguments"))
        namespace = item.get("namespace")
        if isinstance(namespace, str) and namespace:
            name = flat_tool_name(namespace, name)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_call_message(call: dict[str, Any], prev_assistant: Message | None) -> Message | None:
    if prev_assistant is not None:
        prev_assistant.setdefault("tool_calls", []).append(call)
        return None
    return {"role": "assistant", "tool_calls": [call]}


def _parts_with_text(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        raise APIError(400, f"{where}.{key} must be a list of parts with text", "input")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The first content part's text, else the first summary's (vLLM warns: content is what it reads)."""
    if item.get("encrypted_content"):
        raise APIError(400, "Encrypted content is not supported.", "input")
    content = _parts_with_text(item.get("content"), where, "content")
    if "summary" not in item:
        raise APIError(400, f"{where}.summary must be a list of parts with text", "input")
    summary = _parts_with_text(item["summary"], where, "summary")
    if content:
        return content[0]["text"]
    if summary:
        logger.warning("Using summary text as reasoning content for item %s. Please use content instead of "
                       "summary for reasoning items.", item.get("id"))
        return summary[0]["text"]
    return ""


def _reasoning_message(reasoning: str, prev_assistant: Message | None) -> Message | None:
    if prev_assistant is not None and prev_assistant.get("reasoning") is None:
        prev_assistant["reasoning"] = reasoning
        return None
    return {"role": "assistant", "reasoning": reasoning}


def _tool_output_message(item: dict[str, Any], where: str) -> Message:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise APIError(400, f"{where}: a {item['type']} item needs call_id (a string)", "input")
    return {"role": "tool", "content": _text_of(item.get("output"), where, "output"), "tool_call_id": call_id}


def _part_texts(content: Any, where: str, key: str) -> list[str]:
    """The texts of a content (a string, or input_text / output_text / refusal parts); other parts are a 400."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.{key} must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text_key = _TEXT_KEYS.get(kind or "")
        if text_key is None:
            raise APIError(400, f"{where}.{key}.{j}: only text parts are supported (input_text, output_text, "
                                f"refusal), got {kind!r}", "input")
        if not isinstance(part.get(text_key), str):
            raise APIError(400, f"{where}.{key}.{j}.{text_key} must be a string", "input")
        texts.append(part[text_key])
    return texts


def _text_of(content: Any, where: str, key: str = "content") -> str:
    """A content's text parts joined with newlines, as chat joins them."""
    return "\n".join(_part_texts(content, where, key))


def _message(item: dict[str, Any], where: str, prev_assistant: Message | None) -> Message | None:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(400, f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}",
                       "input")
    texts = _part_texts(item.get("content"), where, "content")
    if role != "assistant":
        return {"role": role, "content": "\n".join(texts)}
    text = texts[0] if texts else ""  # vLLM reads the first part only
    if prev_assistant is not None and prev_assistant.get("content") is None:
        prev_assistant["content"] = text
        return None
    return {"role": "assistant", "content": text}
