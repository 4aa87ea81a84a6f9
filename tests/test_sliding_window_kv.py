"""SlidingWindowKVCacheManager (vLLM's SlidingWindowManager) on its own: blocks that fall out of the
window are freed to NULL_BLOCK, prefix hits need only the window's last blocks, admission is capped."""

from __future__ import annotations

from tokenloom.core.block_pool import NULL_BLOCK, BlockPool
from tokenloom.core.request import Request
from tokenloom.core.single_type_kv_cache_manager import SlidingWindowManager
from tokenloom.core.sliding_window import SlidingWindowKVCacheManager
from tokenloom.sampling_params import SamplingParams

BS, W = 4, 8  # two blocks per window


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), block_size=BS)


def _run_prefill(kv: SlidingWindowKVCacheManager, req: Request, chunk: int) -> None:
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n


def test_blocks_outside_the_window_are_freed() -> None:
    kv = SlidingWindowKVCacheManager(32, BS, 256, W, max_num_batched_tokens=8)
    req = _req("a", list(range(40)))
    _run_prefill(kv, req, 8)
    blocks = kv.req_to_blocks["a"]
    # The next token (position 40) sees 33..40: blocks 0..7 (tokens 0..31) are gone; the last
    # chunk's allocation ran with 32 computed, so blocks up to token 24 were freed then.
    assert blocks[:6] == [NULL_BLOCK] * 6 and all(b is not NULL_BLOCK for b in blocks[6:])
    assert kv.num_blocks_held("a") == 4
    assert kv.block_pool.get_num_free_blocks() == 32 - 4
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == 32


def test_prefix_hit_needs_only_the_window_tail() -> None:
    kv = SlidingWindowKVCacheManager(64, BS, 256, W, max_num_batched_tokens=64)
    tokens = list(range(30))
    first = _req("a", tokens + [100, 101])
    _run_prefill(kv, first, 64)
    # The first request's early blocks were freed but keep their hashes (evictable cached blocks):
    # a second request with the same 28-token prefix hits all 7 full blocks it may hit.
    second = _req("b", tokens + [200, 201])
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 28 and len(blocks.blocks[0]) == 7
    # Evict the early blocks: the hit still holds, from the right, with nulls in front.
    kv.block_pool.cached_block_hash_to_block.pop(first.block_hashes[0])
    kv.block_pool.cached_block_hash_to_block.pop(first.block_hashes[1])
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 28 and blocks.blocks[0][:2] == [NULL_BLOCK, NULL_BLOCK]
    assert kv.allocate_slots(second, 4, 28, blocks) is not None
    held = kv.req_to_blocks["b"]
    assert held[: (28 - W + 1) // BS] == [NULL_BLOCK] * ((28 - W + 1) // BS)
    # A hole inside the window breaks the hit back to the run before it.
    kv.block_pool.cached_block_hash_to_block.pop(first.block_hashes[5])
    third = _req("c", tokens + [300, 301])
    _, hit = kv.get_computed_blocks(third)
    assert hit == 20  # blocks 3, 4 (tokens 12..19) are the last two-block run before the hole


def test_admission_is_capped_by_the_window() -> None:
    # 17 free blocks cannot hold a 100-token prompt (25 blocks), but with a window of 8 and chunks of
    # 8 a request never holds more than cdiv(7 + 8, 4) + 1 = 5: it is admitted and runs to the end.
    kv = SlidingWindowKVCacheManager(17, BS, 256, W, max_num_batched_tokens=8)
    req = _req("long", list(range(100)))
    assert kv.allocate_slots(req, 8, full_sequence_must_fit=True) is not None
    req.num_computed_tokens = 8
    _run_prefill(kv, req, 8)
    assert kv.num_blocks_held("long") <= 5


def test_blocks_leave_the_window_only_when_whole() -> None:
    """vLLM's test_sliding_window_remove_skipped_blocks on blocks taken from the pool (its own fixture uses
    off-pool blocks, which tokenloom's double-free check refuses): window 4, blocks of 2."""
    pool = BlockPool(2000)
    manager = SlidingWindowManager(pool, block_size=2, sliding_window=4, max_model_len=64, max_num_batched_tokens=8)
    original = manager.allocate_new_blocks("test", 22)  # 11 blocks
    for num_computed, num_null in ((0, 0), (4, 0), (5, 1), (6, 1), (7, 2), (11, 4)):
        # The next token after `num_computed` reads tokens num_computed - 3 .. num_computed: a block leaves
        # only once both its tokens are before that.
        manager.remove_skipped_blocks("test", num_computed)
        assert manager.req_to_blocks["test"] == [NULL_BLOCK] * num_null + original[num_null:], num_computed
    # The last call freed blocks 3 then 2: the deeper one is reused (evicted) first.
    assert pool.free_block_queue.get_all_free_blocks()[:4] == [original[3], original[2], original[1], original[0]]
