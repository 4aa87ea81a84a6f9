"""The offline LLM's arguments, checked before any request is queued.

A wrong argument gets a ValueError or TypeError that names it ("priority: 1 value for 2 prompts"),
not an error raised deep inside in words about some other object ("list index out of range",
"replace() should be called on dataclass instances", a Jinja UndefinedError), and never a request
queued before the bad one is found.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from tokenloom.exceptions import ValidationError

T = TypeVar("T")


def prompt_list(prompts: Any) -> list[Any]:
    """vLLM's `prompts`: one prompt (text, a dict, a list of token ids) or an iterable of them."""
    if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a string, a dict, a list of token ids, or a list of those, got "
                        f"{type(prompts).__name__}")
    return list(prompts)


def per_prompt(value: T | Iterable[T], cls: type, n: int, name: str) -> list[T]:
    """One `cls` for every prompt, or one per prompt (`name`: the argument, for the message)."""
    if isinstance(value, cls):
        return [value] * n
    if isinstance(value, str | bytes | dict) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a {cls.__name__} or a list of them (one per prompt), got "
                        f"{type(value).__name__}")
    values = list(value)
    bad = next((v for v in values if not isinstance(v, cls)), None)
    if bad is not None:
        raise TypeError(f"{name} must be a {cls.__name__} or a list of them (one per prompt), got a list holding "
                        f"a {type(bad).__name__}")
    if len(values) != n:
        raise ValidationError(f"{name} must be one {cls.__name__} or one per prompt", parameter=name)
    return values


def priority_list(priority: Any, n: int) -> list[int]:
    """vLLM's `priority`: one integer per prompt, or one integer for every prompt (None: all 0)."""
    if priority is None:
        return [0] * n
    if isinstance(priority, int) and not isinstance(priority, bool):
        return [priority] * n
    if isinstance(priority, str | bytes | dict) or not isinstance(priority, Iterable):
        raise TypeError(f"priority must be an integer or a list of integers, one per prompt, got "
                        f"{type(priority).__name__}")
    values = list(priority)
    if any(isinstance(p, bool) or not isinstance(p, int) for p in values):
        raise TypeError(f"priority must be a list of integers, one per prompt, got {values[:5]!r}")
    if len(values) != n:
        raise ValidationError(f"priority: {len(values)} value(s) for {n} prompt(s) (give one per prompt)",
                              parameter="priority")
    return values


# The content parts that carry text, and the key that holds it (vLLM's chat parsing; the server's too).
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}


def part_text(part: Any) -> str | None:
    """One content part's text: a string as it is, a text part's text (None when it has none: vLLM skips it);
    any other part is a ValueError (these models read text only). The server's parts come here as dicts too."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    key = TEXT_PART_KEYS.get(kind) if isinstance(part, dict) else None
    if key is None:
        raise ValueError(f"only text parts are supported ({', '.join(TEXT_PART_KEYS)}), got {kind!r}")
    value = part.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"the {key!r} of a {kind!r} part must be a string")
    return value


def _joined_parts(where: str, parts: list[Any]) -> str:
    """A list of content parts as one text, joined with newlines (vLLM's "string" content format)."""
    texts = []
    for k, part in enumerate(parts):
        try:
            text = part_text(part)
        except ValueError as exc:
            raise ValueError(f"messages: {where}, content part {k}: {exc}") from None
        if text is not None:
            texts.append(text)
    return "\n".join(texts)


def conversations(messages: Any, join_parts: bool = True) -> list[list[dict[str, Any]]]:
    """LLM.chat's `messages`: one conversation (a list of message dicts) or a list of conversations.
    `join_parts`: content given as a list of parts becomes their joined text (else the template gets the list)."""
    if isinstance(messages, list | tuple) and messages and isinstance(messages[0], dict):
        messages = [messages]
    if not isinstance(messages, list | tuple) or not all(
            isinstance(conv, list | tuple) and all(isinstance(m, dict) for m in conv) for conv in messages):
        raise TypeError("messages must be a conversation (a list of message dicts, each with a 'role' and "
                        "'content') or a list of conversations")
    for i, conv in enumerate(messages):
        for j, message in enumerate(conv):
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages: conversation {i}, message {j} needs a 'role' (a string), got "
                                 f"{message.get('role')!r}")
            if not isinstance(message.get("content"), str | list | None):
                raise ValueError(f"messages: conversation {i}, message {j}: 'content' must be a string or a list of "
                                 f"content parts, got {type(message['content']).__name__}")
    def normalized(i: int, j: int, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if content is None:  # no content renders as empty text, as vLLM's chat parsing and the server do
            return {**message, "content": ""}
        if join_parts and isinstance(content, list):
            return {**message, "content": _joined_parts(f"conversation {i}, message {j}", content)}
        return message

    return [[normalized(i, j, m) for j, m in enumerate(conv)] for i, conv in enumerate(messages)]


def render_conversation(tokenizer: Any, i: int, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                        continue_final_message: bool = False, chat_template: str | None = None,
                        tools: list[dict[str, Any]] | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat template over one conversation, as token ids. A template that fails on these messages
    (content of the wrong type, roles out of order...) is the caller's mistake: a ValueError saying which."""
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=True,
                                             **(chat_template_kwargs or {}))
    except Exception as exc:  # Jinja raises its own types (UndefinedError, TemplateError), templates raise anything
        raise ValueError(f"cannot apply the chat template to conversation {i}: {type(exc).__name__}: {exc}") from None
