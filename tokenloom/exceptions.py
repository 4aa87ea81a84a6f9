"""The error a refused request or parameter raises, whichever front end it came through.

vLLM raises `vllm.exceptions.VLLMValidationError` for these (sampling parameters out of range, an empty or
too long prompt, arguments that do not match the prompts); code and tests written for vLLM catch it by that
name, so tokenloom exports it under both names. Unlike vLLM's it is also a ValueError: tokenloom's callers
(and vLLM's older ones) catch ValueError for a bad request, and that must keep working.
"""

from __future__ import annotations

from typing import Any


class VLLMError(Exception):
    """vLLM's base class of its own errors."""


class VLLMClientError(VLLMError):
    """vLLM's: an error the request caused (answered with a 4xx)."""


class ValidationError(ValueError, VLLMClientError):
    """A request or parameter refused as sent (a client error). `parameter` names the field when one is
    to blame, `value` the value refused; the message stays the whole text (the server's JSON carries the
    parameter apart)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


VLLMValidationError = ValidationError  # vLLM's name, for code written against vllm.exceptions

__all__ = ["VLLMClientError", "VLLMError", "ValidationError", "VLLMValidationError"]
