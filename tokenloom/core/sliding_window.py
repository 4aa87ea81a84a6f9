"""KV-cache accounting for a model whose every layer attends over a sliding window (Mistral,
Phi-3 with sliding_window, Qwen with use_sliding_window): vLLM's SlidingWindowManager
(vllm/v1/core/single_type_kv_cache_manager.py).

A query at position p reads keys p - W + 1 .. p. Once a request has computed n tokens, the next
token needs none of the first n - W + 1 tokens, so every whole block among them is freed and its
place in the request's block table taken by `NULL_BLOCK` (`remove_skipped_blocks`, run by
`allocate_slots` before it counts what it needs). A long sequence then holds at most
cdiv(W - 1 + chunk, block_size) + 1 blocks, whatever its length.

Prefix caching as vLLM does it for sliding windows (`find_longest_cache_hit`): a hit needs only
the last cdiv(W - 1, block_size) blocks before the hit's end to be cached, so the lookup scans from
the right for that many contiguous cached blocks; the blocks before them are NULL_BLOCK.

Admission (`full_sequence_must_fit`) counts at most vLLM's per-request cap
(`SlidingWindowSpec.max_admission_blocks_per_request`): cdiv(min(W - 1 + max_num_batched_tokens,
max_model_len), block_size) + 1 blocks.

Models that mix sliding and full-attention layers (Gemma 2/3) keep the plain KVCacheManager: one
block id spans every layer here, so a block can be freed only when no layer reads it (vLLM's
per-group block tables are not built; see docs/models.md).
"""

from __future__ import annotations

from tokenloom.core.block_pool import NULL_BLOCK, KVCacheBlock
from tokenloom.core.kv_cache_manager import KVCacheManager, cdiv
from tokenloom.core.request import Request, RequestStatus


class SlidingWindowKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, sliding_window: int,
                 max_num_batched_tokens: int, enable_caching: bool = True, watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, max_model_len, enable_caching, watermark)
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.admission_cap_blocks = cdiv(min(sliding_window - 1 + max_num_batched_tokens, max_model_len),
                                         block_size) + 1

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token to compute."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    # Prefix cache -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        needed = cdiv(self.sliding_window - 1, self.block_size)
        computed = [NULL_BLOCK] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(request.block_hashes[i])
            if block is None:
                run = 0
                continue
            computed[i] = block
            run += 1
            if run >= needed:
                del computed[i + run :]
                break
        else:
            # No run long enough: only a run from block 0 is a hit (nothing before it is needed).
            del computed[run:]
        return computed, len(computed) * self.block_size

    # Allocation -------------------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks wholly before the window; NULL_BLOCK takes their place."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        last = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        freed = []
        for i in range(last - 1, -1, -1):
            if blocks[i] is NULL_BLOCK:
                break
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
        if freed:
            self.block_pool.free_blocks(freed)

    def _num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock],
                                num_computed_tokens: int = 0, admission: bool = False) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        if admission:
            num_required = min(num_required, self.admission_cap_blocks)
        num_owned = len(self.req_to_blocks.get(request_id, ()))
        if num_owned:  # running: no new prefix hit
            return max(num_required - num_owned, 0)
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped, len(new_computed_blocks)), 0)
        num_evictable = sum(1 for b in new_computed_blocks[num_skipped:] if b is not NULL_BLOCK and b.ref_cnt == 0)
        return num_new + num_evictable

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_slots in vLLM's order for a sliding-window group: admission check
        (capped), free what fell out of the window, then count and allocate."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens to adopt")
        new_computed = new_computed_blocks or []
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed, self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        rid = request.request_id
        if full_sequence_must_fit:
            full_len = min(request.num_tokens, self.max_model_len)
            need = self._num_blocks_to_allocate(rid, full_len, new_computed, total_computed, admission=True)
            if need + watermark > self.block_pool.get_num_free_blocks():
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        self.remove_skipped_blocks(rid, total_computed)  # even if the allocation below fails (as vLLM)
        need = self._num_blocks_to_allocate(rid, num_tokens_need_slot, new_computed, total_computed)
        if need + watermark > self.block_pool.get_num_free_blocks():
            return None

        req_blocks = self.req_to_blocks.setdefault(rid, [])
        if new_computed:
            # The hit's leading blocks the window no longer needs are not taken (null from the start).
            num_skipped = self.num_skipped_tokens(total_computed) // self.block_size
            adopted = [NULL_BLOCK] * min(num_skipped, len(new_computed)) + new_computed[num_skipped:]
            self.block_pool.touch(adopted)
            req_blocks.extend(adopted)
            self.num_cached_block[rid] = len(adopted)
        num_missing = cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_missing) if num_missing > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def num_blocks_held(self, request_id: str) -> int:
        """Real blocks the request holds (its NULL_BLOCK entries excluded)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not NULL_BLOCK)
