"""KVCacheManager: which blocks each request owns, prefix-cache lookups, and allocate_slots.

`allocate_slots` either succeeds whole or changes nothing: it counts what it needs (new blocks plus
prefix-hit blocks it would pull out of the free queue) before touching anything, and returns None
when the pool cannot give it. The scheduler answers None by preempting.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.core.block_pool import BlockPool, KVCacheBlock
from tokenloom.core.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """vLLM's PrefixCacheStats: lookups since the last `make_prefix_cache_stats()` (per interval).

    Requests resumed after preemption are counted apart (`preempted_*`), as in vLLM, so the hit rate
    of new requests is not inflated by recomputations finding their own blocks.
    """

    reset: bool = False  # reset_prefix_cache ran in this interval
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # vLLM sizes the watermark from KVCacheConfig.num_blocks, which counts its null block
        # (block 0, never usable) too: int(watermark * (usable + 1)) (vllm/v1/core/kv_cache_manager.py:208).
        self.watermark_blocks = int(watermark * (num_blocks + 1))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request already carry their hash.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()  # this interval (vLLM semantics)
        self.prefix_cache_totals = PrefixCacheStats()  # since start, for Prometheus counters

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    # Prefix cache -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading full blocks already in the cache, and its length in tokens.

        At most num_tokens - 1 tokens may hit: the last token must be computed to get logits,
        so a full hit recomputes its last block.
        """
        # vLLM: a request that wants prompt_logprobs computes its whole prompt (a hit would skip rows).
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.enable_caching:
            preempted = request.num_preemptions > 0
            self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted)
            self.prefix_cache_totals.record(request.num_tokens, num_hits, preempted)

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """This interval's stats; the next interval starts empty (vLLM's make_prefix_cache_stats)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # Allocation -------------------------------------------------------------------------------
    def _num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        num_owned = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(num_required - len(new_computed_blocks) - num_owned, 0)
        # A hit block sitting in the free queue leaves it when touched: it costs a free block too.
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
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
        """Make room for `num_new_tokens` more tokens of `request` (after its prefix hit, if any).

        Returns the newly allocated blocks (possibly empty), or None if the pool cannot hold them,
        in which case nothing changed.
        """
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens to adopt")
        new_computed = new_computed_blocks or []
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed, self.max_model_len)

        # The watermark holds back headroom only from admissions, and only if someone else runs.
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        num_free = self.block_pool.get_num_free_blocks()

        if full_sequence_must_fit:
            full_len = min(request.num_tokens, self.max_model_len)
            need = self._num_blocks_to_allocate(request.request_id, full_len, new_computed)
            if need + watermark > num_free:
                return None

        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        need = self._num_blocks_to_allocate(request.request_id, num_tokens_need_slot, new_computed)
        if need + watermark > num_free:
            return None

        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed:
            self.block_pool.touch(new_computed)
            req_blocks.extend(new_computed)
            self.num_cached_block[request.request_id] = len(new_computed)
        num_missing = cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_missing) if num_missing > 0 else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Only verified tokens are cached (never draft tokens that may be rejected).
            self._cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request_id], request.block_hashes, num_cached, num_full
            )
            self.num_cached_block[request_id] = num_full

    def free(self, request: Request) -> None:
        """Return a request's blocks, tail first, so its deepest blocks are evicted before its root."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks freeing the request would return (a sliding-window manager leaves out NULL_BLOCK)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True
