"""BlockPool and KVCacheManager behaviours (vLLM's test_prefix_caching / test_kv_cache_utils, as behaviours).

Block ids here start at 0 (tokenloom has no null block), so vLLM's expected ids are shifted by one.
"""

from __future__ import annotations

import pytest

from tokenloom.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from tokenloom.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from tokenloom.core.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], block_size: int = 16) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=100), block_size=block_size)


def ids(blocks) -> list[int]:
    """Block ids of a list of blocks, or of a one-group KVCacheBlocks."""
    if isinstance(blocks, KVCacheBlocks):
        (blocks,) = blocks.blocks
    return [b.block_id for b in blocks]


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # O(1) from the middle
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append_n([blocks[0]])
    q.prepend_n([blocks[2]])
    assert ids(q.get_all_free_blocks()) == [2, 1, 3, 4, 0]
    assert ids(q.popleft_n(5)) == [2, 1, 3, 4, 0]
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()


def test_prefill_hits_and_free_order() -> None:
    """vLLM test_prefill: 48 common + 7 unique tokens, then 48 common + 5."""
    kv = KVCacheManager(num_blocks=10, block_size=16, max_model_len=1024)
    common = list(range(48))
    r0 = make_request("0", common + [100 + i for i in range(7)])
    blocks, n = kv.get_computed_blocks(r0)
    assert (ids(blocks), n) == ([], 0)
    assert ids(kv.allocate_slots(r0, 55, n, blocks)) == [0, 1, 2, 3]
    pool = kv.block_pool
    assert all(pool.blocks[i].block_hash is not None and pool.blocks[i].ref_cnt == 1 for i in range(3))
    assert pool.blocks[3].block_hash is None  # partial block: never matchable
    r0.num_computed_tokens = 55

    r1 = make_request("1", common + [200 + i for i in range(5)])
    blocks, n = kv.get_computed_blocks(r1)
    assert ids(blocks) == [0, 1, 2] and n == 48
    assert ids(kv.allocate_slots(r1, 5, n, blocks)) == [4]
    assert [pool.blocks[i].ref_cnt for i in range(3)] == [2, 2, 2]
    r1.num_computed_tokens = 53

    kv.free(r0)
    kv.free(r1)
    # Unhashed blocks first (reused at once), then cached blocks tail-first (deepest evicted first).
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]
    # A 160-token miss takes every block in exactly that order.
    r2 = make_request("2", [999] * 160)
    assert ids(kv.allocate_slots(r2, 160)) == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]


def test_full_hit_still_computes_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=16, max_model_len=1024)
    r0 = make_request("0", list(range(33)))
    kv.allocate_slots(r0, 33)
    r0.num_computed_tokens = 33
    r1 = make_request("1", list(range(32)))  # exactly two full blocks, both cached
    blocks, n = kv.get_computed_blocks(r1)
    assert n == 16 and len(ids(blocks)) == 1  # at most num_tokens - 1 = 31 tokens may hit


def test_decode_allocates_only_at_block_boundary() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=16, max_model_len=1024)
    r = make_request("0", list(range(20)))
    assert len(ids(kv.allocate_slots(r, 20))) == 2
    r.num_computed_tokens = 20
    for _ in range(4):  # tokens 21..24 stay in block 1
        r.append_output_token_ids(7)
        assert ids(kv.allocate_slots(r, 1)) == []
        r.num_computed_tokens += 1
    assert kv.block_pool.blocks[1].block_hash is None
    for _ in range(8):
        r.append_output_token_ids(7)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    assert r.num_computed_tokens == 32 and kv.block_pool.blocks[1].block_hash is not None
    r.append_output_token_ids(7)
    assert len(ids(kv.allocate_slots(r, 1))) == 1


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=16, max_model_len=1024)
    r0 = make_request("0", list(range(48)))
    kv.allocate_slots(r0, 48)
    r0.num_computed_tokens = 48
    kv.free(r0)  # 3 cached blocks now sit in the free queue
    r1 = make_request("1", list(range(48)) + [5] * 40)  # hits 3 blocks, needs 6 in all (pool: 4)
    blocks, n = kv.get_computed_blocks(r1)
    assert n == 48
    before = [(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks]
    free_before = ids(kv.block_pool.free_block_queue.get_all_free_blocks())
    assert kv.allocate_slots(r1, 88 - 48, n, blocks) is None
    assert [(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks] == before
    assert ids(kv.block_pool.free_block_queue.get_all_free_blocks()) == free_before
    assert "1" not in kv.req_to_blocks


def test_hit_blocks_are_not_evicted_by_their_own_allocation() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=16, max_model_len=1024)
    r0 = make_request("0", list(range(32)))
    kv.allocate_slots(r0, 32)
    kv.free(r0)
    r1 = make_request("1", list(range(32)) + [9] * 20)
    blocks, n = kv.get_computed_blocks(r1)
    hit = ids(blocks)
    new = kv.allocate_slots(r1, 52 - n, n, blocks)
    assert not set(hit) & set(ids(new))
    assert kv.get_block_ids("1")[0][: len(hit)] == hit


def test_prefix_caching_disabled_and_capacity() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, max_model_len=1024, enable_caching=False)
    r0 = make_request("0", list(range(10)), block_size=4)
    kv.allocate_slots(r0, 10)
    r1 = make_request("1", list(range(10)), block_size=4)
    blocks, n = kv.get_computed_blocks(r1)
    assert (ids(blocks), n) == ([], 0)
    assert kv.allocate_slots(r1, 10) is None  # 3 + 3 > 5


def test_watermark_only_holds_back_admissions() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=16, max_model_len=1024, watermark=0.2)
    waiting = make_request("w", list(range(16 * 9)))
    assert kv.allocate_slots(waiting, 16 * 9, has_scheduled_reqs=True) is None  # 9 + 2 > 10
    assert kv.allocate_slots(waiting, 16 * 9, has_scheduled_reqs=False) is not None
    running = make_request("r", [1] * 16)
    running.status = RequestStatus.RUNNING
    assert kv.allocate_slots(running, 16) is not None  # the last free block, no watermark


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=16, max_model_len=1024)
    r = make_request("0", list(range(32)))
    kv.allocate_slots(r, 32)
    assert not kv.reset_prefix_cache()  # blocks in use
    kv.free(r)
    assert kv.reset_prefix_cache()
    assert not kv.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


def test_recycled_cached_block_loses_its_hash() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [1234], 0, 1)
    assert pool.get_cached_block(1234) is b
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # takes the cached free block too: its content is evicted
    assert pool.get_cached_block(1234) is None and b.block_hash is None


def test_two_blocks_under_one_hash_are_evicted_one_at_a_time() -> None:
    """What vLLM's test_maybe_evict_cached_block checks (its assertions read vLLM's own map layout): the
    same content cached twice keeps both blocks under its hash, a hit takes the first, and evicting one
    leaves the other hittable until it goes too."""
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [1234], 0, 1)
    pool.cache_full_blocks([second], [1234], 0, 1)
    pool.free_blocks([first, second])
    assert pool.get_cached_block(1234) is first
    assert pool.get_new_blocks(1) == [first]  # reused: its hash goes, the other block's stays
    assert first.block_hash is None and pool.get_cached_block(1234) is second
    assert pool.get_new_blocks(1) == [second]
    assert pool.get_cached_block(1234) is None and not pool.cached_block_hash_to_block
