"""Whether a request can ever be served: the one check behind the scheduler's RequestRejected and the
API server's HTTP 400 (each caller words the answer its own way, the server after vLLM's wording).

The KV blocks a request needs at its longest are counted as vLLM counts a request's share of the pool
(`_max_memory_usage_bytes_from_groups` / `get_max_concurrency_for_kv_cache_config`,
vllm/v1/core/kv_cache_utils.py): every KV cache group claims its own blocks from the one shared pool,
so the need is the sum over groups; a full-attention group needs cdiv(tokens, block_size), a
sliding-window group at most its admission cap (`SlidingWindowSpec.max_admission_blocks_per_request`:
cdiv(min(W - 1 + tokens in flight, max_model_len), block_size) + 1), since the blocks that left its
window are freed as the request runs. vLLM checks this once at start-up for max_model_len ("To serve
at least one request with the model's max seq len ..."); tokenloom lets the pool be smaller than
max_model_len and checks each request against it instead, so a request that could never finish is
refused up front rather than waiting forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.core.kv_cache_groups import KVCacheGroupSpec


@dataclass(frozen=True)
class PromptFit:
    num_prompt_tokens: int
    max_model_len: int
    final_len: int  # the longest the request can grow: prompt + max_tokens, capped at max_model_len
    blocks_needed: int  # KV blocks at that length, every group together
    num_blocks: int  # KV blocks in the pool
    blocks_per_group: tuple[int, ...] = ()  # each group's share of blocks_needed
    group_windows: tuple[int | None, ...] = ()  # each group's sliding window (None: full attention)

    @property
    def empty(self) -> bool:
        return self.num_prompt_tokens == 0

    @property
    def no_room_to_generate(self) -> bool:
        return self.num_prompt_tokens >= self.max_model_len

    @property
    def exceeds_pool(self) -> bool:
        """It could never finish: at its longest its groups together need more blocks than the pool."""
        return self.blocks_needed > self.num_blocks

    @property
    def per_group(self) -> str:
        """What each group needs, for messages ("" with one full-attention group: nothing to add).
        E.g. '66 in the full-attention group, 33 in each of 5 sliding-window groups (window 512)'."""
        if self.group_windows in ((), (None,)):
            return ""
        parts: dict[tuple[int | None, int], int] = {}
        for window, blocks in zip(self.group_windows, self.blocks_per_group):
            parts[(window, blocks)] = parts.get((window, blocks), 0) + 1
        words = []
        for (window, blocks), count in sorted(parts.items(), key=lambda p: (p[0][0] is not None, p[0][0] or 0)):
            kind = "full-attention" if window is None else "sliding-window"
            tail = "" if window is None else f" (window {window})"
            if count == 1:
                words.append(f"{blocks} in the {kind} group{tail}")
            else:
                words.append(f"{blocks} in each of {count} {kind} groups{tail}")
        return ", ".join(words)


def prompt_fit(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int,
               kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
               max_in_flight_tokens: int | None = None) -> PromptFit:
    """`kv_cache_groups`: the model's groups (None: one full-attention group);
    `max_in_flight_tokens` (tokens scheduled but not yet settled, `kv_cache_groups.max_in_flight_tokens`)
    sizes a sliding group's cap and is required with one."""
    final_len = min(num_prompt_tokens + max_tokens, max_model_len)
    groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec((0,))]
    if max_in_flight_tokens is None and any(g.sliding_window is not None for g in groups):
        raise ValueError("prompt_fit with a sliding-window KV cache group needs max_in_flight_tokens")
    # The last sampled token is never fed back, so the KV holds at most final_len - 1 tokens.
    per_group = tuple(g.max_blocks_per_request(final_len - 1, block_size, max_in_flight_tokens or 0, max_model_len)
                      for g in groups)
    return PromptFit(num_prompt_tokens, max_model_len, final_len, sum(per_group), num_blocks, per_group,
                     tuple(g.sliding_window for g in groups))


def max_model_len_that_fits(num_blocks: int, block_size: int, max_model_len: int,
                            kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
                            max_in_flight_tokens: int | None = None) -> int:
    """The largest max_model_len (at most `max_model_len`) one request of which fits the pool, every
    group counted as vLLM's start-up check does (cdiv(max_model_len, block_size) blocks for a full
    group, its cap for a sliding one); 0 if not even 1 fits. vLLM's `estimate_max_model_len`: a binary
    search, since a sliding group's cap itself depends on max_model_len."""
    groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec((0,))]
    in_flight = max_in_flight_tokens or 0

    def fits(length: int) -> bool:
        return sum(g.max_blocks_per_request(length, block_size, in_flight, length) for g in groups) <= num_blocks

    lo, hi = 0, max_model_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
