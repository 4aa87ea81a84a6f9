"""Prefix-cache block hashes: vLLM's (vllm/utils/hashing.py, vllm/v1/core/kv_cache_utils.py).

A block's hash is a digest of (parent hash, the block's token ids, extra keys) by the engine's
`prefix_caching_hash_algo`, chained from a root parent (vLLM's NONE_HASH). Digests, not Python's
`hash()`: an int's hash is its value modulo 2**61-1, so two prompts whose blocks hash alike could be
built on purpose and one request would be served another's KV (CVE-2025-25183; vLLM's fix: sha256 by
default). A block hash is `bytes` (32 for sha256, 16 for xxhash's XXH3-128).

The CBOR variants serialize with canonical CBOR (RFC 8949 section 4.2.1), written here for the only
values a block hash is taken of (ints, bytes, str, None, tuples) rather than pulling in cbor2: the
bytes are cbor2.dumps(..., canonical=True)'s for them, so the digests are vLLM's.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
from collections.abc import Callable
from typing import Any, NewType, get_args

from tokenloom import envs
from tokenloom.config import PrefixCachingHashAlgo

BlockHash = NewType("BlockHash", bytes)

HASH_ALGOS: tuple[str, ...] = get_args(PrefixCachingHashAlgo)
DEFAULT_HASH_ALGO = "sha256"
# The widest digest (sha256): the disk tier's and the P/D wire's fixed-size hash field.
MAX_DIGEST_BYTES = 32

# vLLM's DEFAULT_NONE_HASH_SEED: the root parent is hash_fn(seed), as vLLM's NONE_HASH.
DEFAULT_ROOT_SEED = "vllm-none-hash"


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form (canonical)."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(f"CBOR cannot encode {n} in a head; bignums are not used in block hashes")


@functools.lru_cache(maxsize=1 << 18)
def _cbor_int(value: int) -> bytes:
    """Cached: a block's items are token ids, drawn from a vocabulary, so a few hundred thousand at most."""
    return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)


def canonical_cbor(value: Any) -> bytes:
    """Canonical CBOR of ints (64-bit), bytes, str, None, bool and tuples / lists of them."""
    if type(value) is int:
        return _cbor_int(value)
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):  # an int subclass (an IntEnum): its value
        return _cbor_int(int(value))
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(map(canonical_cbor, value))
    raise TypeError(f"a block hash input cannot hold {type(value).__name__} (CBOR: ints, bytes, str, None, tuples)")


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash as _xxhash
    except ImportError:
        raise ModuleNotFoundError(_XXHASH_MISSING) from None
    return _xxhash.xxh3_128_digest(data)


_XXHASH_MISSING = ("xxhash is required for the 'xxhash' prefix caching hash algorithms. "
                   "Install it via `pip install xxhash`.")  # vLLM's words


def sha256(value: Any) -> bytes:
    return hashlib.sha256(_pickled(value)).digest()


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(canonical_cbor(value)).digest()


def xxhash(value: Any) -> bytes:
    return _xxh3_128(_pickled(value))


def xxhash_cbor(value: Any) -> bytes:
    return _xxh3_128(canonical_cbor(value))


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash, "xxhash_cbor": xxhash_cbor}


def get_hash_fn_by_name(name: str) -> Callable[[Any], bytes]:
    """vLLM's: the hash function of an algorithm name, or ValueError."""
    try:
        return _HASH_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unsupported hash function: {name}") from None


def root_seed() -> str:
    """What the root parent is derived from. PYTHONHASHSEED when set, as vLLM, so an operator can make the
    root secret; else a fixed seed for every algorithm. vLLM 0.32 draws a random per-process seed for the
    xxhash ones instead (they are not collision resistant, so their root must stay unguessable); tokenloom
    keeps the root fixed: the data-parallel router hashes prompts in its own process, a decode engine
    fetches a prefill engine's blocks by hash, and the KV disk tier finds its blocks after a restart, all of
    which need the same root in every process. Choosing xxhash is choosing speed over collision resistance
    (logged by the engine); set PYTHONHASHSEED to keep its root private."""
    return envs.PYTHONHASHSEED or DEFAULT_ROOT_SEED


@functools.cache
def _root_parent(algo: str, seed: str) -> BlockHash:
    return BlockHash(get_hash_fn_by_name(algo)(seed))


def root_parent_hash(algo: str = DEFAULT_HASH_ALGO) -> BlockHash:
    """The parent of a request's first block (vLLM's NONE_HASH) under `algo`."""
    return _root_parent(algo, root_seed())


def hash_block_tokens(parent_hash: bytes | None, block_token_ids: tuple[int, ...],
                      extra_keys: tuple[Any, ...] | None = None, algo: str = DEFAULT_HASH_ALGO) -> BlockHash:
    """Hash of one full block, chained to its parent so equal blocks at different depths differ: vLLM's
    hash_function((parent, tokens, extra_keys)). `extra_keys`: what else the block's KV depends on (the LoRA
    adapter); None for the base model."""
    parent = root_parent_hash(algo) if parent_hash is None else parent_hash
    return BlockHash(get_hash_fn_by_name(algo)((parent, tuple(block_token_ids), extra_keys or None)))


def padded_hash(block_hash: bytes) -> bytes:
    """A block hash in the fixed-size field of the disk tier's header and the P/D wire (zero-padded; the
    KV fingerprint names the algorithm, so both ends agree on the digest length)."""
    if len(block_hash) > MAX_DIGEST_BYTES:
        raise ValueError(f"a block hash is at most {MAX_DIGEST_BYTES} bytes, got {len(block_hash)}")
    return block_hash.ljust(MAX_DIGEST_BYTES, b"\0")
