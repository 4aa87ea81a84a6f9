"""Errors the engine's clients raise, in a leaf module so that every client and executor can raise them
without importing one another."""

from __future__ import annotations


class EngineStartError(RuntimeError):
    """An engine core (or one of its ranks) could not start: the cause is in the message."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing can be served any more."""
