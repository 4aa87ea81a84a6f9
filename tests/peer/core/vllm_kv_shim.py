"""Plumbing that lets vLLM's KV-cache-manager unit tests (tests/v1/core: test_prefix_caching.py,
test_single_type_kv_cache_manager.py, test_kv_cache_utils.py) run against tokenloom.core unchanged.

Only names, shapes and the numbering of blocks are adapted, never behaviour; anything a test asserts is
tokenloom's own answer. The mappings:

* **Block ids.** vLLM's pool of `num_blocks` holds its null block at id 0 (never allocated) and the usable
  blocks at 1..num_blocks-1; tokenloom's pool holds only usable blocks, numbered from 0, and its `NULL_BLOCK`
  (id 0) stands apart. The shim builds tokenloom's pool with `num_blocks - 1` blocks and numbers them from 1,
  with `blocks[0]` the null block, so `pool.blocks[i].block_id == i` and every id a test expects is vLLM's.
* **Hashes.** tokenloom's block hashes are vLLM's (tokenloom/core/block_hash.py): `sha256` and `sha256_cbor`
  are tokenloom's own functions, `init_none_hash(hash_fn)` sets this module's NONE_HASH to tokenloom's root
  parent under that function, and `get_request_block_hasher(block_size, hash_fn)` makes a Request hash with
  it (the engine's prefix_caching_hash_algo). A hash function tokenloom does not have (the builtin `hash`,
  the default of test_kv_cache_utils.py's make_request, whose cases compare no digests) hashes with the
  default, sha256. A block's prefix-cache key is `block_hash_with_group_id` (group 0: the plain hash;
  others: (hash, group)), vLLM's BlockHashWithGroupId.
* **The hash map.** tokenloom's `cached_block_hash_to_block` is a dict of {block_id: block} per key; the shim
  gives it vLLM's `insert` and `_cache` (the raw dict, which the tests pop and restore entries of).
* **Signatures.** vLLM's KVCacheManager, BlockPool and SlidingWindowManager take specs and keyword arguments
  tokenloom spells differently (one block size, a window per group); the shim translates and refuses what
  tokenloom has no counterpart for (EAGLE, KV events, KV connectors' external tokens, multimodal inputs,
  cache_salt, several block sizes) with NotImplementedError, so such a case cannot pass by accident.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

from tests.peer.core import vllm_kv_hashing as _hashing
from tests.peer.core.vllm_kv_hashing import (
    DEFAULT_NONE_HASH_SEED,
    get_none_hash_seed,
    init_none_hash,
    resolve_none_hash_seed,
    sha256,
    sha256_cbor,
    xxhash,
    xxhash_cbor,
)
from tests.peer.core.vllm_shim import FreeKVCacheBlockQueue
from tests.peer.core.vllm_shim import KVCacheBlock as _VllmNamedBlock
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.block_pool import NULL_BLOCK, block_hash_with_group_id
from tokenloom.core.block_pool import BlockPool as _TLBlockPool
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec as _TLGroupSpec
from tokenloom.core.kv_cache_manager import KVCacheBlocks, PrefixCacheStats
from tokenloom.core.kv_cache_manager import KVCacheManager as _TLKVCacheManager
from tokenloom.core.request import Request as _TLRequest
from tokenloom.core.request import RequestStatus
from tokenloom.core.request import hash_block_tokens as _tl_hash_block_tokens
from tokenloom.core.scheduler import Scheduler as _TLScheduler
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.core.single_type_kv_cache_manager import SlidingWindowManager as _TLSlidingWindowManager
from tokenloom.engine.stat_logging import CachingMetrics
from tokenloom.lora.request import LoRARequest
from tokenloom.sampling_params import SamplingParams as _TLSamplingParams

__all__ = ["BlockHash", "BlockHashWithGroupId", "BlockPool", "CachingMetrics", "FreeKVCacheBlockQueue",
           "FullAttentionSpec", "KVCacheBlock", "KVCacheBlocks", "KVCacheConfig", "KVCacheGroupSpec",
           "KVCacheManager", "KVCacheTensor", "KVQuantMode", "LoRARequest", "MambaSpec", "MultiModalFeatureSpec",
           "MultiModalKwargsItem", "NONE_HASH", "PlaceholderRange", "PrefixCacheStats", "Request", "RequestStatus",  # noqa: F822 - module __getattr__
           "SamplingParams", "SlidingWindowManager", "SlidingWindowSpec", "create_scheduler", "get_block_hash",
           "get_group_id", "get_request_block_hasher", "hash_block_tokens", "init_none_hash",
           "make_block_hash_with_group_id", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "DEFAULT_NONE_HASH_SEED",
           "get_none_hash_seed", "resolve_none_hash_seed"]


# Hashing ----------------------------------------------------------------------------------------------------
def __getattr__(name: str) -> Any:
    """NONE_HASH lives in vllm_kv_hashing (init_none_hash sets it there); read through this module as vLLM's."""
    if name == "NONE_HASH":
        return _hashing.NONE_HASH
    raise AttributeError(name)


def hash_block_tokens(hash_fn: Any, parent_block_hash: bytes | None, curr_block_token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> bytes:
    return _tl_hash_block_tokens(parent_block_hash, tuple(curr_block_token_ids), extra_keys, _hashing.algo_of(hash_fn))


def BlockHash(value: bytes) -> bytes:  # noqa: N802 - vLLM's NewType
    return value


BlockHashWithGroupId = BlockHash
make_block_hash_with_group_id = block_hash_with_group_id


def get_block_hash(key: Hashable) -> Hashable:
    return key[0] if isinstance(key, tuple) else key


def get_group_id(key: Hashable) -> int:
    return key[1] if isinstance(key, tuple) else 0


# Blocks and the pool ----------------------------------------------------------------------------------------
class KVCacheBlock(_VllmNamedBlock):
    """tokenloom's block with vLLM's names: free-list links (vllm_shim) and the hash setters."""

    __slots__ = ()

    def set_block_hash(self, block_hash: Hashable, num_tokens: int | None = None) -> None:
        self.block_hash = block_hash

    def reset_hash(self) -> None:
        self.block_hash = None


class _BlockHashMap(dict):
    """tokenloom's hash map ({key: {block_id: block}}) with vLLM's `insert` and `_cache` (the dict itself)."""

    def insert(self, key: Hashable, block: KVCacheBlock) -> None:
        self.setdefault(key, {})[block.block_id] = block

    @property
    def _cache(self) -> _BlockHashMap:
        return self


class BlockPool(_TLBlockPool):
    """tokenloom's BlockPool in vLLM's layout (blocks[0] the null block, usable blocks from id 1) with vLLM's
    constructor and the two methods the tests call with vLLM's signatures. tokenloom's own calls (one group id,
    positional arguments) go through unchanged."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int | None = None,
                 enable_kv_cache_events: bool = False, **unused: Any) -> None:
        if enable_kv_cache_events:
            raise NotImplementedError("tokenloom publishes no KV cache events")
        super().__init__(num_gpu_blocks - 1, enable_caching)
        adopt_vllm_layout(self)

    def get_cached_block(self, block_hash: Hashable, kv_cache_group_ids: Any = 0) -> Any:
        if isinstance(kv_cache_group_ids, int):  # tokenloom's own call: one group, one block or None
            return super().get_cached_block(block_hash, kv_cache_group_ids)  # type: ignore[arg-type]
        found = [super(BlockPool, self).get_cached_block(block_hash, g) for g in kv_cache_group_ids]  # type: ignore[arg-type]
        return None if any(b is None for b in found) else found

    def cache_full_blocks(self, *args: Any, request: _TLRequest | None = None, **kwargs: Any) -> None:
        if request is None:  # tokenloom's own call
            super().cache_full_blocks(*args, **kwargs)
            return
        if kwargs.get("block_size") not in (None, request.block_size) or kwargs.get("block_mask") is not None:
            raise NotImplementedError("tokenloom hashes and caches at one block size, every full block")
        super().cache_full_blocks(kwargs["blocks"], request.block_hashes, kwargs["num_cached_blocks"],
                                  kwargs["num_full_blocks"], kwargs.get("kv_cache_group_id", 0))

    @property
    def null_block(self) -> Any:
        return NULL_BLOCK


def adopt_vllm_layout(pool: _TLBlockPool) -> None:
    """Renumber a fresh tokenloom pool's blocks from 1 and put the null block at blocks[0] (vLLM's layout), with
    vLLM's names on the blocks, the free queue and the hash map."""
    assert not pool.cached_block_hash_to_block and pool.get_num_free_blocks() == pool.num_blocks, "a fresh pool"
    pool.__class__ = BlockPool
    for block in pool.blocks:
        block.block_id += 1
        block.__class__ = KVCacheBlock
    pool.blocks = [NULL_BLOCK, *pool.blocks]
    pool.cached_block_hash_to_block = _BlockHashMap()
    queue = pool.free_block_queue
    queue.__class__ = FreeKVCacheBlockQueue
    queue._head.__class__ = KVCacheBlock
    queue._tail.__class__ = KVCacheBlock


# Specs and configs ------------------------------------------------------------------------------------------
class KVQuantMode(Enum):
    NONE = "none"


@dataclass
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: Any = None
    page_size_padded: int | None = None
    sliding_window: int | None = None  # vLLM: windowed layers folded into a full-attention group
    attention_chunk_size: int | None = None
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE


@dataclass
class SlidingWindowSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: Any = None
    sliding_window: int = 1
    page_size_padded: int | None = None

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The most blocks a request of this group is counted for at admission: tokenloom's rule."""
        group = _TLGroupSpec((0,), self.sliding_window)
        return group.admission_cap_blocks(self.block_size, max_in_flight_tokens, max_model_len)  # type: ignore[return-value]


def MambaSpec(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    raise NotImplementedError("tokenloom has no Mamba (state-space) KV cache groups")


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheTensor:
    size: int
    layers: list[str] = field(default_factory=list)
    layer_stride: int | None = None
    block_stride: int | None = None


@dataclass
class KVCacheConfig:
    num_blocks: int  # vLLM's count, its null block included
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]


def _tokenloom_groups(config: KVCacheConfig) -> tuple[int, list[_TLGroupSpec]]:
    """The one block size and tokenloom's groups (a window per group) of a vLLM KVCacheConfig."""
    block_sizes = {g.kv_cache_spec.block_size for g in config.kv_cache_groups}
    if len(block_sizes) != 1:
        raise NotImplementedError("tokenloom's KV cache groups share one block size")
    groups = []
    for i, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        groups.append(_TLGroupSpec((i,), window))
    return block_sizes.pop(), groups


class KVCacheManager(_TLKVCacheManager):
    """tokenloom's KVCacheManager with vLLM's constructor (a KVCacheConfig), its pool in vLLM's layout, and
    vLLM's shapes at the seams the tests read: get_computed_blocks' third value (the shared-prefix boundary of
    sparse retention, which tokenloom has not: 0), `coordinator.single_type_managers`, `new_step_starts`."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int | None = None,
                 hash_block_size: int | None = None, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, watermark: float = 0.0, **unused: Any) -> None:
        if use_eagle:
            raise NotImplementedError("tokenloom has no EAGLE drafter (its drafts are n-gram)")
        if enable_kv_cache_events:
            raise NotImplementedError("tokenloom publishes no KV cache events")
        block_size, groups = _tokenloom_groups(kv_cache_config)
        if hash_block_size not in (None, block_size) or scheduler_block_size not in (None, block_size):
            raise NotImplementedError("tokenloom hashes and schedules at its one block size")
        # vLLM: without max_in_flight_tokens the sliding-window admission cap falls back to max_model_len.
        super().__init__(kv_cache_config.num_blocks - 1, block_size, max_model_len, enable_caching, watermark,
                         kv_cache_groups=groups, max_num_batched_tokens=max_in_flight_tokens or max_model_len)
        adopt_vllm_layout(self.block_pool)

    @property
    def coordinator(self) -> SimpleNamespace:
        return SimpleNamespace(single_type_managers=self.managers)

    def new_step_starts(self) -> None:
        """vLLM's per-step hook (Mamba's speculative state); nothing to do for attention groups."""

    def get_computed_blocks(self, request: _TLRequest) -> tuple[KVCacheBlocks, int, int]:  # type: ignore[override]
        blocks, num_tokens = super().get_computed_blocks(request)
        return blocks, num_tokens, 0

    def allocate_slots(self, request: _TLRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,  # type: ignore[override]
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, **unused: Any) -> KVCacheBlocks | None:
        if num_external_computed_tokens or reserved_blocks:
            raise NotImplementedError("KV connector loads (external tokens, reserved blocks) are not modelled here")
        if num_encoder_tokens:
            raise NotImplementedError("tokenloom serves decoder-only models (no cross-attention blocks)")
        return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                      num_lookahead_tokens, full_sequence_must_fit=full_sequence_must_fit,
                                      has_scheduled_reqs=has_scheduled_reqs, delay_cache_blocks=delay_cache_blocks)


class SlidingWindowManager(_TLSlidingWindowManager):
    """tokenloom's sliding-window manager with vLLM's constructor (the spec, the admission cap given) and
    vLLM's signatures for the calls the tests make on it directly."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: _TLBlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int | None = None,
                 needs_kv_cache_zeroing: bool = False, max_admission_blocks_per_request: int | None = None,
                 **unused: Any) -> None:
        if needs_kv_cache_zeroing:
            raise NotImplementedError("tokenloom's workers do not zero new KV blocks")
        if scheduler_block_size not in (None, kv_cache_spec.block_size):
            raise NotImplementedError("tokenloom schedules at its one block size")
        # tokenloom sizes the cap from the window, the tokens in flight and max_model_len; vLLM's caller passes it.
        super().__init__(block_pool, kv_cache_spec.block_size, kv_cache_spec.sliding_window, max_model_len=1,
                         max_num_batched_tokens=1, group_id=kv_cache_group_id, enable_caching=enable_caching)
        self.admission_cap_blocks = max_admission_blocks_per_request

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,  # type: ignore[override]
                                   new_computed_blocks: Sequence[Any], total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        return super().get_num_blocks_to_allocate(request_id, num_tokens, list(new_computed_blocks),
                                                  total_computed_tokens, admission=apply_admission_cap)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[Any],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        if num_external_computed_tokens:
            raise NotImplementedError("KV connector loads (external tokens) are not modelled here")
        self.add_computed_blocks(request_id, list(new_computed_blocks), num_local_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,  # type: ignore[override]
                            num_tokens_main_model: int | None = None) -> list[Any]:
        return super().allocate_new_blocks(request_id, num_tokens)

    def find_longest_cache_hit(self, block_hashes: list[Any], max_length: int,  # type: ignore[override]
                               kv_cache_group_ids: list[int], block_pool: Any = None, kv_cache_spec: Any = None,
                               drop_eagle_block: bool = False,
                               alignment_tokens: int | None = None) -> tuple[tuple[list[Any], ...], int]:
        """vLLM's classmethod takes the pool and spec; tokenloom's manager holds them."""
        assert block_pool in (None, self.block_pool)
        if drop_eagle_block or alignment_tokens not in (None, self.block_size):
            raise NotImplementedError("no EAGLE block drop, no alignment finer or coarser than the block")
        hits = super().find_longest_cache_hit(block_hashes, max_length // self.block_size, kv_cache_group_ids)
        return tuple(hits), len(hits[0]) * self.block_size


# Requests ---------------------------------------------------------------------------------------------------
class SamplingParams(_TLSamplingParams):
    def update_from_generation_config(self, generation_config: dict, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id


def get_request_block_hasher(block_size: int, hash_fn: Any) -> SimpleNamespace:
    """vLLM's hasher closure; a tokenloom Request hashes its own full blocks at its block size and algorithm."""
    return SimpleNamespace(block_size=block_size, algo=_hashing.algo_of(hash_fn))


def Request(request_id: str, prompt_token_ids: list[int] | None, sampling_params: _TLSamplingParams,  # noqa: N802
            pooling_params: Any = None, mm_features: Any = None, lora_request: Any = None,
            cache_salt: str | None = None, block_hasher: SimpleNamespace | None = None,
            prompt_embeds: Any = None, **unused: Any) -> _TLRequest:
    if mm_features or prompt_embeds is not None:
        raise NotImplementedError("tokenloom serves text prompts (no multimodal features, no prompt embeds)")
    if cache_salt is not None:
        raise NotImplementedError("tokenloom has no cache_salt (its server refuses the field)")
    request = _TLRequest(request_id, prompt_token_ids or [], sampling_params, pooling_params=pooling_params,
                         lora_request=lora_request)
    if block_hasher is not None:
        request.set_block_size(block_hasher.block_size, block_hasher.algo)
    return request


def MultiModalFeatureSpec(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    raise NotImplementedError("tokenloom serves text models (no multimodal features)")


MultiModalKwargsItem = SimpleNamespace(dummy=lambda: None)
PlaceholderRange = MultiModalFeatureSpec


# Schedulers -------------------------------------------------------------------------------------------------
def create_scheduler(max_num_seqs: int = 16, max_num_batched_tokens: int = 8192, enable_chunked_prefill: bool = True,
                     enable_prefix_caching: bool = False, num_blocks: int = 10000, block_size: int = 16,
                     max_model_len: int | None = None, async_scheduling: bool = False,
                     kv_cache_spec: Any = None, **unused: Any) -> _TLScheduler:
    """vLLM's tests/v1/core/utils.py create_scheduler (its defaults: prefix caching off, facebook/opt-125m, whose
    2,048 positions the scheduler reads) for the KV-level cases: tokenloom's Scheduler, or AsyncScheduler, over
    one KV cache group of `kv_cache_spec` (a sliding window or full attention). vLLM's pool counts its null block.
    The scheduler's KVCacheManager gets vLLM's `coordinator.single_type_managers` and each manager its
    `_null_block`, the names the tests read."""
    if kv_cache_spec is not None and kv_cache_spec.block_size != block_size:
        raise NotImplementedError("tokenloom's KV cache groups share the scheduler's block size")
    window = kv_cache_spec.sliding_window if isinstance(kv_cache_spec, SlidingWindowSpec) else None
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=2048, enable_chunked_prefill=enable_chunked_prefill,
                            async_scheduling=async_scheduling)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks - 1, enable_prefix_caching=enable_prefix_caching,
                        layer_windows=None if window is None else (window,))
    scheduler = make_scheduler(sched, cache, clock=lambda: 0.0)
    kv = scheduler.kv_cache_manager
    kv.coordinator = SimpleNamespace(single_type_managers=kv.managers)  # type: ignore[attr-defined]
    for manager in kv.managers:
        manager._null_block = NULL_BLOCK  # type: ignore[attr-defined]
    return scheduler
