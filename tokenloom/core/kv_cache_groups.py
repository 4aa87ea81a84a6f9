"""KV-cache groups: which layers share one block table (vLLM's KVCacheGroupSpec and
`_get_kv_cache_groups_uniform_page_size`, vllm/v1/core/kv_cache_utils.py).

A model whose layers all attend the same way (all full attention, or all over one sliding window)
has one group: one block table per request, addressing every layer's K/V. A model that mixes
sliding-window and full-attention layers (Gemma 2: alternating; Gemma 3: five sliding to one
global) gets vLLM's hybrid layout instead:

* layers are bucketed by attention type; `group_size` = the smallest bucket's size (the "1" of an
  n:1 pattern), or the largest when no bucket is 1.5x the smallest (few padding layers);
* each bucket is cut into cdiv(len, group_size) groups, layers[i::num_groups] in group i (groups
  may be short: vLLM's padding layers, whose memory is never read);
* one KV block holds `group_size` layers' K/V for `block_size` tokens, and layer j of every group
  uses the same slot j of it: a block id means different layers in different groups, but a block
  belongs to one group's request at a time, so nothing is shared.

Each group has its own block table per request, kept by its own manager (full attention or
sliding window, tokenloom/core/single_type_kv_cache_manager.py): a sliding group frees the blocks
that fall out of its window while the full group keeps the whole sequence. Gemma 3 with 26 layers
(22 sliding, 4 global) has 7 groups of 4 layers: 6 sliding (the last two 1 layer short), 1 full.

`hybrid=False` is vLLM's --disable-hybrid-kv-cache-manager: every layer in one full-attention
group (sliding layers keep all blocks and mask by position), the behaviour before hybrid groups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The model layers one block table serves, and how they attend."""

    layer_ids: tuple[int, ...]  # model layer indices; layer_ids[j] uses slot j of each block
    sliding_window: int | None = None  # None: full attention

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError("a KV cache group needs at least one layer")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def admission_cap_blocks(self, block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        """Most blocks a request ever holds in this group (None: no cap, full attention): vLLM's
        `SlidingWindowSpec.max_admission_blocks_per_request`. A sliding group keeps the last W - 1
        computed tokens plus the tokens in flight (freeing runs on computed tokens), never more than
        max_model_len; +1 because the window need not start at a block boundary."""
        if self.sliding_window is None:
            return None
        return sliding_window_cap_blocks(self.sliding_window, block_size, max_in_flight_tokens, max_model_len)

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_in_flight_tokens: int,
                               max_model_len: int) -> int:
        """Most blocks a request of `num_tokens` KV tokens holds at once in this group (vLLM's
        per-group `max_memory_usage_bytes / page_size`, for this request's length)."""
        blocks = -(-num_tokens // block_size)
        cap = self.admission_cap_blocks(block_size, max_in_flight_tokens, max_model_len)
        return blocks if cap is None else min(blocks, cap)


def sliding_window_cap_blocks(sliding_window: int, block_size: int, max_in_flight_tokens: int,
                              max_model_len: int) -> int:
    """KVCacheGroupSpec.admission_cap_blocks of a group with this window."""
    return -(-min(sliding_window - 1 + max_in_flight_tokens, max_model_len) // block_size) + 1


def max_in_flight_tokens(max_num_batched_tokens: int, async_scheduling: bool = False) -> int:
    """Tokens scheduled but not yet settled (vLLM's `VllmConfig.max_in_flight_tokens`): one batch, or
    two with async scheduling (step N+1 is scheduled while step N runs)."""
    return max_num_batched_tokens * (2 if async_scheduling else 1)


def make_kv_cache_groups(layer_windows: list[int | None] | tuple[int | None, ...] | None,
                         num_layers: int | None = None, hybrid: bool = True) -> list[KVCacheGroupSpec]:
    """The KV cache groups for layers with these sliding windows (None: full attention).

    `layer_windows` None: `num_layers` full-attention layers (one group). One attention type: one
    group of every layer. Mixed types: vLLM's uniform-page-size grouping with `hybrid`, else one
    full-attention group (sliding layers mask instead of freeing).
    """
    if layer_windows is None:
        if num_layers is None or num_layers < 1:
            raise ValueError("make_kv_cache_groups needs layer_windows or num_layers >= 1")
        return [KVCacheGroupSpec(tuple(range(num_layers)))]
    windows = list(layer_windows)
    if not windows:
        raise ValueError("a model needs at least one attention layer")
    kinds = list(dict.fromkeys(windows))  # attention types, in order of first appearance
    if len(kinds) == 1:
        return [KVCacheGroupSpec(tuple(range(len(windows))), kinds[0])]
    if not hybrid:
        return [KVCacheGroupSpec(tuple(range(len(windows))))]
    buckets = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    smallest = min(len(layers) for layers in buckets.values())
    largest = max(len(layers) for layers in buckets.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KVCacheGroupSpec] = []
    # Types in order of their first layer, as vLLM's dict of specs (Gemma: the sliding groups first).
    for kind in kinds:
        layers = buckets[kind]
        num_groups = -(-len(layers) // group_size)
        groups += [KVCacheGroupSpec(tuple(layers[i::num_groups]), kind) for i in range(num_groups)]
    return groups


def layers_per_block(groups: list[KVCacheGroupSpec]) -> int:
    """How many layers' K/V one block holds: the largest group (vLLM pads the others to it)."""
    return max(len(g.layer_ids) for g in groups)
