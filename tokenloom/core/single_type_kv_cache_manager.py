"""One KV cache group's block tables (vLLM's SingleTypeKVCacheManager / FullAttentionManager,
vllm/v1/core/single_type_kv_cache_manager.py).

A manager keeps, for each request, the blocks of its group (`req_to_blocks`) and how many of them
carry their hash; `KVCacheManager` (tokenloom/core/kv_cache_manager.py) runs one per group over a
shared `BlockPool` and sums what they need. The counting here is the one copy for every kind of
group: a full-attention group skips no tokens and has no admission cap, a sliding-window group
(tokenloom/core/sliding_window.py) overrides `num_skipped_tokens`, `admission_cap_blocks` and the
prefix-cache lookup (the sliding-window rules are explained in tokenloom/core/sliding_window.py).
"""

from __future__ import annotations

from tokenloom.core.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from tokenloom.core.kv_cache_groups import sliding_window_cap_blocks
from tokenloom.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionManager:
    """A group whose layers attend over every earlier token: a request keeps all its blocks."""

    sliding_window: int | None = None
    # Most blocks a request of this group counts at admission (None: no cap).
    admission_cap_blocks: int | None = None

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int = 0, enable_caching: bool = True) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request already carry their hash.
        self.num_cached_block: dict[str, int] = {}

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens the next token to compute no longer reads (none, with full attention)."""
        return 0

    # Prefix cache -----------------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: list[int], max_num_blocks: int,
                               group_ids: list[int] | None = None) -> list[list[KVCacheBlock]]:
        """The longest run of leading blocks cached in every one of `group_ids` (default: this
        group), at most `max_num_blocks`; one list per group."""
        group_ids = [self.group_id] if group_ids is None else group_ids
        hits: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        for block_hash in block_hashes[:max_num_blocks]:
            found = [self.block_pool.get_cached_block(block_hash, g) for g in group_ids]
            if any(b is None for b in found):
                break
            for hit, block in zip(hits, found):
                hit.append(block)  # type: ignore[arg-type]
        return hits

    # Allocation -------------------------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock],
                                   num_computed_tokens: int, admission: bool = False) -> int:
        """Free blocks that giving the request `num_tokens` slots (after adopting its prefix hit
        `new_computed_blocks`) would take from the pool. `admission`: the full-sequence check,
        capped at `admission_cap_blocks`."""
        num_required = -(-num_tokens // self.block_size)
        if admission and self.admission_cap_blocks is not None:
            num_required = min(num_required, self.admission_cap_blocks)
        owned = self.req_to_blocks.get(request_id)
        if owned:  # running: no new prefix hit
            return max(num_required - len(owned), 0)
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped, len(new_computed_blocks)), 0)
        # A hit block sitting in the free queue leaves it when touched: it costs a free block too
        # (blocks the window has already left are not taken at all).
        num_evictable = sum(1 for b in new_computed_blocks[num_skipped:] if b is not NULL_BLOCK and b.ref_cnt == 0)
        return num_new + num_evictable

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks wholly before what the next token reads; NULL_BLOCK takes
        their place (nothing to do for full attention)."""
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

    def add_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock],
                            num_computed_tokens: int) -> None:
        """Adopt a prefix hit; its leading blocks the window no longer needs are not taken."""
        if not new_computed_blocks:
            return
        num_skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        adopted = [NULL_BLOCK] * min(num_skipped, len(new_computed_blocks)) + new_computed_blocks[num_skipped:]
        self.block_pool.touch(adopted)
        self.req_to_blocks.setdefault(request_id, []).extend(adopted)
        self.num_cached_block[request_id] = len(adopted)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_missing = -(-num_tokens // self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_missing) if num_missing > 0 else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Commit the request's full blocks among its first `num_tokens` tokens to the prefix cache."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], request.block_hashes, num_cached,
                                              num_full, self.group_id)
            self.num_cached_block[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Return a request's blocks, tail first, so its deepest blocks are evicted before its root."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def num_blocks_held(self, request_id: str) -> int:
        """Real blocks the request holds (NULL_BLOCK entries excluded)."""
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not NULL_BLOCK)



class SlidingWindowManager(FullAttentionManager):
    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int, max_model_len: int,
                 max_num_batched_tokens: int, group_id: int = 0, enable_caching: bool = True) -> None:
        super().__init__(block_pool, block_size, group_id, enable_caching)
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        # `max_num_batched_tokens`: the tokens in flight (doubled by the scheduler under async scheduling).
        self.admission_cap_blocks = sliding_window_cap_blocks(sliding_window, block_size, max_num_batched_tokens,
                                                              max_model_len)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token to compute."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: list[int], max_num_blocks: int,
                               group_ids: list[int] | None = None) -> list[list[KVCacheBlock]]:
        """From the right: the first run of cdiv(W - 1, block_size) blocks cached in every group of
        `group_ids` ends the hit; the blocks before it are NULL_BLOCK. Without such a run only a
        run from block 0 is a hit (nothing before it is needed)."""
        group_ids = [self.group_id] if group_ids is None else group_ids
        needed = cdiv(self.sliding_window - 1, self.block_size)
        hits: list[list[KVCacheBlock]] = [[NULL_BLOCK] * max_num_blocks for _ in group_ids]
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            found = [self.block_pool.get_cached_block(block_hashes[i], g) for g in group_ids]
            if any(b is None for b in found):
                run = 0
                continue
            for hit, block in zip(hits, found):
                hit[i] = block  # type: ignore[assignment]
            run += 1
            if run >= needed:
                for hit in hits:
                    del hit[i + run :]
                return hits
        for hit in hits:
            del hit[run:]
        return hits

