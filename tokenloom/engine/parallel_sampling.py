"""Parallel sampling (`n > 1`): one user request fans out into n core requests (vLLM's
v1/engine/parallel_sampling.py). The offline LLMEngine and the server's AsyncLLM both use it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenloom.core.request import Request
from tokenloom.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    """n == 1 keeps the user's id; otherwise `{index}_{request_id}`, vLLM's naming."""
    return request_id if n == 1 else f"{index}_{request_id}"


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
            arrival_time: float, priority: int = 0, lora_request: Any = None, *, reasoning_ended: bool | None = None,
            reasoning_parser_kwargs: dict[str, Any] | None = None) -> list[Request]:  # fmt: skip
    """The n core requests of one user request. Each samples once (n=1) with its own seed (seed + i,
    so the n completions differ but repeat run to run) and the model's EOS token; each has its own
    reasoning gate (reasoning_ended, reasoning_parser_kwargs: see Request)."""
    cores = []
    for i in range(params.n):
        child = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        child.eos_token_id = eos_token_id
        core_id = child_request_id(request_id, i, params.n)
        cores.append(Request(core_id, prompt_token_ids, child, arrival_time=arrival_time, priority=priority,
                             lora_request=lora_request, reasoning_ended=reasoning_ended,
                             reasoning_parser_kwargs=reasoning_parser_kwargs))
    return cores
