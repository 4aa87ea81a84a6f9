"""A KV cache group whose layers attend over a sliding window: vLLM's SlidingWindowManager
(vllm/v1/core/single_type_kv_cache_manager.py). The group of every layer of Mistral, Phi-3 with
sliding_window or Qwen with use_sliding_window; the sliding groups of Gemma 2/3 (hybrid groups,
tokenloom/core/kv_cache_groups.py).

A query at position p reads keys p - W + 1 .. p. Once a request has computed n tokens, the next
token needs none of the first n - W + 1 tokens, so every whole block among them is freed and its
place in the request's block table taken by `NULL_BLOCK` (`remove_skipped_blocks`, which
`KVCacheManager.allocate_slots` runs before it counts what it needs). A long sequence then holds at
most cdiv(W - 1 + chunk, block_size) + 1 blocks of this group, whatever its length.

Prefix caching as vLLM does it for sliding windows (`find_longest_cache_hit`): a hit needs only
the last cdiv(W - 1, block_size) blocks before the hit's end to be cached, so the lookup scans from
the right for that many contiguous cached blocks; the blocks before them are NULL_BLOCK.

Admission (`full_sequence_must_fit`) counts at most vLLM's per-request cap
(`SlidingWindowSpec.max_admission_blocks_per_request`): cdiv(min(W - 1 + max_num_batched_tokens,
max_model_len), block_size) + 1 blocks.

The manager itself (`SlidingWindowManager`) sits next to the full-attention one in
tokenloom/core/single_type_kv_cache_manager.py, as in vLLM: the block counting, adoption of hits
and freeing are one copy there, driven by `num_skipped_tokens`. This module keeps the one-group
KVCacheManager for a model whose every layer is windowed.
"""

from __future__ import annotations

from tokenloom.core.kv_cache_groups import KVCacheGroupSpec
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.single_type_kv_cache_manager import SlidingWindowManager

__all__ = ["SlidingWindowKVCacheManager", "SlidingWindowManager"]


class SlidingWindowKVCacheManager(KVCacheManager):
    """A KVCacheManager whose one group is a sliding window (every layer windowed: Mistral)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, sliding_window: int,
                 max_num_batched_tokens: int, enable_caching: bool = True, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, max_model_len, enable_caching, watermark,
                         kv_cache_groups=[KVCacheGroupSpec((0,), sliding_window)],
                         max_num_batched_tokens=max_num_batched_tokens)
        self.sliding_window = sliding_window
