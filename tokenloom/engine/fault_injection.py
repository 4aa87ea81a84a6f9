"""Fault injection for chaos tests: make chosen steps fail inside the model, as a failing kernel would.

Opt-in and off by default: the engine-core process reads `TOKENLOOM_FAULT_INJECT` at start-up.

    TOKENLOOM_FAULT_INJECT="first_token=<id>"   a forward pass that computes position 0 of a prompt
                                                starting with token <id> raises

The fault is raised by the model's forward, after the runner took in the step's bookkeeping (new
requests, finished ones), so what happens next is exactly what a real kernel failure causes:
EngineCore finishes the step's requests with finish_reason "error" (HTTP 500 for each of them) and
the engine goes on serving every other request. A poison first token lets a test pick which step
fails from the outside (send a prompt starting with it) without timing; position 0 is never a
generated token, so no other request trips it by chance.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenloom import envs

logger = logging.getLogger(__name__)

ENV_VAR = "TOKENLOOM_FAULT_INJECT"


class InjectedFault(RuntimeError):
    pass


def parse_spec(spec: str) -> int:
    """The poison token id of a `first_token=<id>` spec; ValueError naming the variable otherwise."""
    key, _, value = spec.partition("=")
    if key.strip() != "first_token" or not value.strip().isdigit():
        raise ValueError(f"{ENV_VAR}={spec!r}: expected 'first_token=<non-negative int>'")
    return int(value)


def install_fault_injection(model: Any, poison_token: int) -> None:
    """Wrap `model.forward(input_ids, positions, ...)` so a step computing a prompt's position 0 with
    token `poison_token` there raises."""
    forward = model.forward

    def faulty_forward(input_ids: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        if bool(((input_ids == poison_token) & (positions == 0)).any()):
            raise InjectedFault(f"injected fault: a prompt starts with token {poison_token} ({ENV_VAR})")
        return forward(input_ids, positions, *args, **kwargs)

    model.forward = faulty_forward
    logger.warning("fault injection is on: steps prefilling a prompt that starts with token %d fail (%s)",
                   poison_token, ENV_VAR)


def install_from_env(runner: Any) -> None:
    """Called by the engine-core process once its runner is built; a no-op unless ENV_VAR is set."""
    spec = envs.TOKENLOOM_FAULT_INJECT
    if spec:
        install_fault_injection(runner.model, parse_spec(spec))
