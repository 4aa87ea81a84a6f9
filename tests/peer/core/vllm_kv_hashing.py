"""vLLM's NONE_HASH state (vllm/v1/core/kv_cache_utils.py) over tokenloom's block hashes, for the vendored KV
tests (re-exported by vllm_kv_shim.py). A module of its own, without classes, so that the vendored cases that
`importlib.reload` vLLM's kv_cache_utils can reload this one without redefining the shim's classes under the other
vendored files' feet."""

from __future__ import annotations

from typing import Any

from tokenloom.core.block_hash import (
    DEFAULT_HASH_ALGO,
    DEFAULT_ROOT_SEED,
    root_parent_hash,
    root_seed,
    sha256,
    sha256_cbor,
    xxhash,
    xxhash_cbor,
)

_ALGO_OF = {sha256: "sha256", sha256_cbor: "sha256_cbor", xxhash: "xxhash", xxhash_cbor: "xxhash_cbor"}
DEFAULT_NONE_HASH_SEED = DEFAULT_ROOT_SEED


def algo_of(hash_fn: Any) -> str:
    return _ALGO_OF.get(hash_fn, DEFAULT_HASH_ALGO)


NONE_HASH = root_parent_hash()  # the parent of a request's first block; init_none_hash sets it per function


_NONE_HASH_SEED: str | None = None


def resolve_none_hash_seed(hash_fn: Any) -> str:
    """vLLM's: the seed NONE_HASH is derived from under `hash_fn` (tokenloom's root_seed: one for every
    algorithm, where vLLM draws a random one for the xxhash ones)."""
    return root_seed()


def get_none_hash_seed() -> str:
    return DEFAULT_NONE_HASH_SEED if _NONE_HASH_SEED is None else _NONE_HASH_SEED


def init_none_hash(hash_fn: Any) -> None:
    """vLLM's: NONE_HASH is the root parent under `hash_fn` (tokenloom's root_parent_hash)."""
    global NONE_HASH, _NONE_HASH_SEED
    _NONE_HASH_SEED = resolve_none_hash_seed(hash_fn)
    NONE_HASH = root_parent_hash(algo_of(hash_fn))
