"""KVCacheManager: which blocks each request owns, prefix-cache lookups, and allocate_slots.

`allocate_slots` either succeeds whole or changes nothing: it counts what it needs (new blocks plus
prefix-hit blocks it would pull out of the free queue) before touching anything, and returns None
when the pool cannot give it. The scheduler answers None by preempting.

The manager is also vLLM's KV cache coordinator (vllm/v1/core/kv_cache_coordinator.py): it runs
one single-type manager per KV cache group (tokenloom/core/kv_cache_groups.py) over one shared
BlockPool. A model with one group (every layer full attention, or every layer windowed) behaves as
before groups existed; a hybrid model (Gemma 2/3: sliding and full layers) gets a block table per
group, the sum of what the groups need is checked against the free blocks, and a prefix hit is the
length every group agrees on (`get_computed_blocks`, vLLM's HybridKVCacheCoordinator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.core.block_pool import BlockPool, KVCacheBlock
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager, cdiv

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats", "cdiv"]


@dataclass
class KVCacheBlocks:
    """Blocks of one request, one list per KV cache group (vLLM's KVCacheBlocks)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([[b.block_id for b in group] for group in self.blocks])


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

    def merge(self, other: PrefixCacheStats) -> None:
        """Fold a later interval into this one (several steps' intervals into one report)."""
        self.reset = self.reset or other.reset
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits
        self.preempted_requests += other.preempted_requests
        self.preempted_queries += other.preempted_queries
        self.preempted_hits += other.preempted_hits

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
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """`kv_cache_groups`: the model's groups (None: one full-attention group).
        `max_num_batched_tokens` sizes a sliding-window group's admission cap (required with one): the
        tokens in flight, vLLM's `max_in_flight_tokens` (the scheduler passes twice the step budget
        under async scheduling, `kv_cache_groups.max_in_flight_tokens`)."""
        self.block_size = block_size
        self.max_in_flight_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # vLLM sizes the watermark from KVCacheConfig.num_blocks, which counts its null block
        # (block 0, never usable) too: int(watermark * (usable + 1)) (vllm/v1/core/kv_cache_manager.py:208).
        self.watermark_blocks = int(watermark * (num_blocks + 1))
        self.kv_cache_groups = list(kv_cache_groups) if kv_cache_groups else [KVCacheGroupSpec((0,))]
        self.managers: tuple[FullAttentionManager, ...] = tuple(
            self._make_manager(group, i, max_num_batched_tokens) for i, group in enumerate(self.kv_cache_groups)
        )
        # Only these free blocks that left a window (remove_skipped_blocks is a no-op for the others).
        self._sliding_managers = [m for m in self.managers if m.sliding_window is not None]
        # Never mutated: a hit's lists are fresh, and allocate_slots only reads what it is given.
        self.empty_blocks = KVCacheBlocks(tuple([] for _ in self.managers))
        # Prefix-cache lookup: groups of one attention type are looked up together, full attention
        # first (its left-to-right scan bounds the others), as vLLM's verify_and_split_kv_cache_groups.
        by_type: dict[int | None, list[int]] = {}
        for i, group in enumerate(self.kv_cache_groups):
            by_type.setdefault(group.sliding_window, []).append(i)
        self.attention_groups: list[list[int]] = sorted(
            by_type.values(), key=lambda ids: self.kv_cache_groups[ids[0]].sliding_window is not None
        )
        self.prefix_cache_stats = PrefixCacheStats()  # this interval (vLLM semantics)
        self.prefix_cache_totals = PrefixCacheStats()  # since start, for Prometheus counters

    def _make_manager(self, group: KVCacheGroupSpec, group_id: int,
                      max_num_batched_tokens: int | None) -> FullAttentionManager:
        if group.sliding_window is None:
            return FullAttentionManager(self.block_pool, self.block_size, group_id, self.enable_caching)
        if max_num_batched_tokens is None:
            raise ValueError("a sliding-window KV cache group needs max_num_batched_tokens (its admission cap)")
        return SlidingWindowManager(self.block_pool, self.block_size, group.sliding_window, self.max_model_len,
                                    max_num_batched_tokens, group_id, self.enable_caching)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """The first group's block table of each request (with one group: the request's blocks).
        Every group holds the same requests: they are allocated and freed together."""
        return self.managers[0].req_to_blocks

    @property
    def num_cached_block(self) -> dict[str, int]:
        return self.managers[0].num_cached_block

    def estimate_cached_tokens(self, request: Request) -> int:
        """vLLM's: how many of the request's tokens sit in the prefix cache (its hashed full blocks),
        the fewest over the groups; 0 without prefix caching."""
        if not self.enable_caching:
            return 0
        return min(m.num_cached_block.get(request.request_id, 0) * m.block_size for m in self.managers)

    # Prefix cache -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The prefix-cache hit, as blocks per group, and its length in tokens.

        At most num_tokens - 1 tokens may hit: the last token must be computed to get logits,
        so a full hit recomputes its last block.
        """
        # vLLM: a request that wants prompt_logprobs computes its whole prompt (a hit would skip rows).
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.empty_blocks, 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        if len(self.managers) == 1:
            hits = self.managers[0].find_longest_cache_hit(request.block_hashes, max_num_blocks)
            return KVCacheBlocks(tuple(hits)), len(hits[0]) * self.block_size
        return self._find_hybrid_cache_hit(request.block_hashes, max_num_blocks)

    def _find_hybrid_cache_hit(self, block_hashes: list[int], max_num_blocks: int) -> tuple[KVCacheBlocks, int]:
        """vLLM's HybridKVCacheCoordinator.find_longest_cache_hit: each attention type accepts the
        candidate length or shortens it, until all agree (full attention is downward-closed: looked
        up once, then cut). With full attention plus one other type, one pass suffices."""
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.managers)
        hit_len = max_num_blocks
        simple = len(self.attention_groups) == 2 and self.managers[self.attention_groups[0][0]].sliding_window is None
        while True:
            curr = hit_len
            for group_ids in self.attention_groups:
                manager = self.managers[group_ids[0]]
                done = hits[group_ids[0]]
                if manager.sliding_window is None and done is not None:
                    curr = min(curr, len(done))
                    continue
                found = manager.find_longest_cache_hit(block_hashes, curr, group_ids)
                curr = len(found[0])
                for gid, blocks in zip(group_ids, found):
                    hits[gid] = blocks
            if curr >= hit_len:
                break
            hit_len = curr
            if simple:
                break
        for gid, manager in enumerate(self.managers):
            blocks = hits[gid]
            if manager.sliding_window is None and blocks is not None:
                del blocks[hit_len:]
        return KVCacheBlocks(tuple(b if b is not None else [] for b in hits)), hit_len * self.block_size

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
    def _num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: tuple[list[KVCacheBlock], ...],
                                num_computed_tokens: int, admission: bool = False) -> int:
        need = 0  # a loop, not sum(generator): this runs for every scheduled request every step
        for m, blocks in zip(self.managers, new_computed):
            need += m.get_num_blocks_to_allocate(request_id, num_tokens, blocks, num_computed_tokens, admission)
        return need

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request` (after its prefix hit, if any),
        in vLLM's order: admission check (sliding groups capped), free what fell out of the
        windows, then count and allocate in every group.

        Returns the newly allocated blocks per group (possibly empty), or None if the pool cannot
        hold them, in which case no block was allocated (blocks that left a window stay freed, as
        in vLLM). `delay_cache_blocks` (vLLM's): the new blocks are not entered into the prefix cache yet
        (a KV connector still loads them; the scheduler caches what loaded when the load is done).
        """
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens to adopt")
        new_computed = (new_computed_blocks or self.empty_blocks).blocks
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed, self.max_model_len)
        rid = request.request_id

        # The watermark holds back headroom only from admissions, and only if someone else runs.
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks

        if full_sequence_must_fit:
            full_len = min(request.num_tokens, self.max_model_len)
            need = self._num_blocks_to_allocate(rid, full_len, new_computed, total_computed, admission=True)
            if need + watermark > self.block_pool.get_num_free_blocks():
                return None

        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        # Free what left the window even if the allocation below fails (as vLLM), on the processed-token
        # basis (vLLM's): under async scheduling num_computed_tokens already counts every step in flight,
        # whose queries still read the W - 1 tokens behind them (a prefill chunk's first token reaches back
        # from the chunk's start) and whose rejected drafts roll the frontier back.
        num_processed = max(0, total_computed - request.num_in_flight_tokens)
        for manager in self._sliding_managers:
            manager.remove_skipped_blocks(rid, num_processed)
        need = self._num_blocks_to_allocate(rid, num_tokens_need_slot, new_computed, total_computed)
        if need + watermark > self.block_pool.get_num_free_blocks():
            return None

        # Every group's hit blocks are touched before any group allocates, so one group's new
        # blocks cannot evict another's hit (vLLM's two-phase allocate_new_computed_blocks).
        if new_computed_blocks is not None:
            for manager, blocks in zip(self.managers, new_computed):
                manager.add_computed_blocks(rid, blocks, total_computed)
        new_blocks = KVCacheBlocks(tuple([m.allocate_new_blocks(rid, num_tokens_need_slot) for m in self.managers]))

        if self.enable_caching and not delay_cache_blocks:
            # Only verified tokens are cached (never draft tokens that may be rejected).
            num_cacheable = min(total_computed + num_new_tokens, request.num_tokens)
            for manager in self.managers:
                manager.cache_blocks(request, num_cacheable)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Commit the full blocks of the first `num_computed_tokens` tokens to the prefix cache (the
        async scheduler calls it once a step's tokens are known; allocate_slots does it otherwise)."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Return a request's blocks, group by group, each tail first (its deepest blocks are
        evicted before its root)."""
        for manager in self.managers:
            manager.free(request.request_id)

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks freeing the request would return, all groups together (NULL_BLOCK left out)."""
        return sum(m.num_blocks_held(request_id) for m in self.managers)

    def num_blocks_held_per_group(self, request_id: str) -> list[int]:
        return [m.num_blocks_held(request_id) for m in self.managers]

    def blocks_needed(self, num_tokens: int) -> int:
        """Most blocks a request of `num_tokens` KV tokens holds at once, every group together: a
        full group cdiv(num_tokens, block_size), a sliding one at most its admission cap (the rule of
        tokenloom/core/prompt_fit.py)."""
        return sum(g.max_blocks_per_request(num_tokens, self.block_size, self.max_in_flight_tokens or 0,
                                            self.max_model_len) for g in self.kv_cache_groups)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.managers)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of each group (vLLM's tuple of lists; NULL_BLOCK is id 0)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True
