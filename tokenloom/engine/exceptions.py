"""Errors the engine's clients raise, in a leaf module so that every client and executor can raise them
without importing one another."""

from __future__ import annotations

# vLLM's words for an engine core that could not start (its tests and users match them), before the cause.
INIT_FAILED = "Engine core initialization failed"


class EngineStartError(RuntimeError):
    """An engine core (or one of its ranks) could not start: the cause is in the message, after INIT_FAILED."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing can be served any more."""


class EngineGenerateError(RuntimeError):
    """vLLM's: AsyncLLM.generate failed on something other than the request as sent (a ValueError, vLLM's
    VLLMValidationError among them) or a dead engine. The request is aborted; the engine goes on (recoverable)."""
