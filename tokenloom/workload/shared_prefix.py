"""The shared-prefix workload (SGLang's `generated-shared-prefix`): groups of requests that share a long
system prompt, each with its own question, in shuffled order.

Prompts are token ids (exact lengths, and the same tokens on every run for a seed), so prefix-cache
hits depend only on where requests are sent and what the engines still hold. `hot_group_fraction`
skews the mix: one group sends that fraction of all requests, the others share the rest equally.
"""

from __future__ import annotations

import numpy as np

from tokenloom.workload.datasets import DEFAULT_VOCAB_RANGE, BenchRequest


def shared_prefix_requests(
    num_groups: int = 12,
    prompts_per_group: int = 16,
    prefix_len: int = 512,
    question_len: int = 32,
    output_len: int = 16,
    hot_group_fraction: float | None = None,
    seed: int = 0,
    vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
) -> list[BenchRequest]:
    """`num_groups * prompts_per_group` requests, shuffled; ids say the group (`g3-7`: group 3, 8th)."""
    for name, value, low in (("num_groups", num_groups, 1), ("prompts_per_group", prompts_per_group, 1),
                             ("prefix_len", prefix_len, 0), ("question_len", question_len, 1),
                             ("output_len", output_len, 1)):
        if value < low:
            raise ValueError(f"shared-prefix {name} must be >= {low}, got {value}")
    if hot_group_fraction is not None and not 0.0 < hot_group_fraction < 1.0:
        raise ValueError(f"shared-prefix hot_group_fraction must be in (0, 1), got {hot_group_fraction}")
    rng = np.random.default_rng(seed)
    lo, hi = vocab_range
    total = num_groups * prompts_per_group
    counts = [prompts_per_group] * num_groups
    if hot_group_fraction is not None and num_groups > 1:
        hot = round(hot_group_fraction * total)
        rest, extra = divmod(total - hot, num_groups - 1)
        counts = [hot] + [rest + (1 if g <= extra else 0) for g in range(1, num_groups)]
    requests = []
    for g, count in enumerate(counts):
        prefix = rng.integers(lo, hi + 1, size=prefix_len).tolist()
        for k in range(count):
            question = rng.integers(lo, hi + 1, size=question_len).tolist()
            prompt = prefix + question
            requests.append(BenchRequest(f"g{g}-{k}", prompt, len(prompt), output_len, ignore_eos=True))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def group_of(request_id: str) -> int:
    """The group index in a shared-prefix request id (`g3-7` -> 3)."""
    return int(request_id[1:].split("-", 1)[0])
