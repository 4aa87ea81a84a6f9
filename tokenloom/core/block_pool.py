"""BlockPool: the fixed pool of KV blocks, its free queue and the prefix-cache hash map.

Eviction order lives in one doubly linked free queue (O(1) removal from the middle when a cached
free block is hit again). The head is evicted first:
- freed blocks without a hash (never matchable) go to the FRONT, reused first;
- freed cached blocks go to the BACK, so cached blocks are evicted least-recently-freed first (LRU),
  and a request frees its blocks tail-first, so a prefix's deepest blocks go before its root.
This is vLLM V1's order (`BlockPool.free_blocks`), which decides which prefixes survive.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def block_hash_with_group_id(block_hash: int, group_id: int) -> Hashable:
    """The prefix-cache key of a block of KV cache group `group_id` (vLLM's BlockHashWithGroupId):
    the same tokens cached by two groups are two blocks (each holds its own layers). Group 0's key
    is the plain hash, so a one-group model's cache is keyed as it always was."""
    return block_hash if group_id == 0 else (block_hash, group_id)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None  # block_hash_with_group_id(...) once cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


# vLLM's null block: what a sliding-window request's block table holds where its blocks fell out
# of the window and were freed. Not in any pool (never allocated, cached or freed); its id 0 is a
# real block's too, which is harmless: attention masks every position it stands for, and nothing
# writes through it.
NULL_BLOCK = KVCacheBlock(0)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks between two sentinels."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            last = self._tail.prev_free
            assert last is not None
            last.next_free = block
            block.prev_free = last
            block.next_free = self._tail
            self._tail.prev_free = block
            self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the front, keeping their order (blocks[0] becomes the head)."""
        for block in reversed(blocks):
            first = self._head.next_free
            assert first is not None
            block.prev_free = self._head
            block.next_free = first
            first.prev_free = block
            self._head.next_free = block
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}; several blocks may hold the same content (computed twice
        # before either was cached). A hit takes the first.
        self.cached_block_hash_to_block: dict[Hashable, dict[int, KVCacheBlock]] = {}

    # Prefix cache ---------------------------------------------------------------------------
    def get_cached_block(self, block_hash: int, group_id: int = 0) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash_with_group_id(block_hash, group_id))
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] their content hash (keyed with their KV
        cache group), making them hittable."""
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            block_hash = block_hash_with_group_id(block_hashes[i], group_id)
            if block is NULL_BLOCK or block.block_hash == block_hash:
                continue
            if block.block_hash is not None:
                self._evict_hash(block)
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def _evict_hash(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        same = self.cached_block_hash_to_block.get(block_hash)
        if same is not None:
            same.pop(block.block_id, None)
            if not same:
                del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        return True

    # Allocation -----------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            # Reusing a cached free block evicts its content from the prefix cache.
            self._evict_hash(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block is NULL_BLOCK:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; ordered_blocks[0] is the first to evict among them."""
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block is NULL_BLOCK:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    evict_first.append(block)
                else:
                    evict_last.append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # Figures --------------------------------------------------------------------------------
    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_num_cached_free_blocks(self) -> int:
        """Free blocks that still hold hittable content (evictable cache)."""
        if not self.enable_caching:
            return 0
        return sum(1 for b in self.free_block_queue.get_all_free_blocks() if b.block_hash is not None)
