"""The collectives the sharded model calls (vLLM's vllm/distributed/communication_op.py), and their
counts (`comm_stats`: the tests check exactly two all-reduces per decoder layer per step)."""

from __future__ import annotations

import torch

from tokenloom.distributed.parallel_state import get_pp_group, get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the TP group (a row-parallel linear's partial sums; a no-op at TP=1)."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The TP ranks' x concatenated along dim (the vocab-parallel LM head's logits)."""
    return get_tp_group().all_gather(x, dim)


def comm_stats() -> dict[str, int]:
    """Collectives this process ran so far: the TP group's all-reduces / all-gathers (and bytes), the
    PP group's sends / receives."""
    tp, pp = get_tp_group().counts, get_pp_group().counts
    return {"all_reduce": tp["all_reduce"], "all_reduce_bytes": tp["all_reduce_bytes"],
            "all_gather": tp["all_gather"], "pp_send": pp["send"], "pp_recv": pp["recv"]}
