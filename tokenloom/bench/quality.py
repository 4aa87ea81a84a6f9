"""Perplexity through the engine's own runner: what quantization costs, measured on the real forward path."""

from __future__ import annotations

import math
from typing import Any

from tokenloom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.sampling_params import SamplingParams


def perplexity(runner: Any, tokens: list[int]) -> float:
    """Teacher-forced perplexity of `tokens` on a ModelRunner, one position per step: each step is a
    new request that reuses the blocks its predecessor wrote (a prefix-cache hit in the scheduler's
    terms), so every next-token distribution comes from the runner's real forward. The runner must be
    idle and hold at least ceil(len(tokens) / block_size) blocks."""
    import torch

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    nll = 0.0
    prev: str | None = None
    for i in range(len(tokens) - 1):
        rid = f"ppl{i}"
        so = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(rid, tokens[: i + 1], tokens[: i + 1], greedy, (blocks,), i)],
            scheduled_cached_reqs=CachedRequestData([], [], []), num_scheduled_tokens={rid: 1},
            total_num_scheduled_tokens=1, finished_req_ids={prev} if prev else set(), preempted_req_ids=set(),
        )
        runner.execute_model(so, return_logits=True)
        assert runner.last_logits is not None
        nll -= torch.log_softmax(runner.last_logits[0].float(), dim=-1)[tokens[i + 1]].item()
        prev = rid
    return math.exp(nll / (len(tokens) - 1))
