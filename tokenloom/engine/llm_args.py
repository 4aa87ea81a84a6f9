"""The offline LLM's arguments, checked before any request is queued.

A wrong argument gets a ValueError or TypeError that names it ("priority: 1 value for 2 prompts"),
not an error raised deep inside in words about some other object ("list index out of range",
"replace() should be called on dataclass instances", a Jinja UndefinedError), and never a request
queued before the bad one is found.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

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
        raise ValueError(f"{name} must be one {cls.__name__} or one per prompt")
    return values


def priority_list(priority: Any, n: int) -> list[int]:
    """vLLM's `priority`: one integer per prompt (None: all 0)."""
    if priority is None:
        return [0] * n
    if isinstance(priority, str | bytes | dict) or not isinstance(priority, Iterable):
        raise TypeError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
    values = list(priority)
    if any(isinstance(p, bool) or not isinstance(p, int) for p in values):
        raise TypeError(f"priority must be a list of integers, one per prompt, got {values[:5]!r}")
    if len(values) != n:
        raise ValueError(f"priority: {len(values)} value(s) for {n} prompt(s) (give one per prompt)")
    return values


def conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """LLM.chat's `messages`: one conversation (a list of message dicts) or a list of conversations."""
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
    # No content renders as empty text, as vLLM's chat parsing and the server do (templates read it)
    return [[m if m.get("content") is not None else {**m, "content": ""} for m in conv] for conv in messages]


def render_conversation(tokenizer: Any, i: int, conversation: list[dict[str, Any]],
                        add_generation_prompt: bool) -> list[int]:
    """The chat template over one conversation, as token ids. A template that fails on these messages
    (content of the wrong type, roles out of order...) is the caller's mistake: a ValueError saying which."""
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tokenize=True)
    except Exception as exc:  # Jinja raises its own types (UndefinedError, TemplateError), templates raise anything
        raise ValueError(f"cannot apply the chat template to conversation {i}: {type(exc).__name__}: {exc}") from None
