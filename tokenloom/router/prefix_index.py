"""PrefixIndex: the router's guess of which prompt blocks each engine still holds in its prefix cache.

SGLang's router keeps an approximate radix tree over request text with one LRU per worker. Here the
keys are the engines' own block hashes (`tokenloom.core.block_hash.hash_block_tokens`, chained from the
first block), so a hash names a whole prefix and "the longest cached prefix" is the longest leading
run of a prompt's hashes found in an engine's set: a set per engine is the radix tree, flattened.

Each engine's set is an LRU bounded in blocks (by default the engine's KV pool, since an engine
cannot hold more). A routed prompt's blocks are touched deepest first, so the root ends up most
recent and a prefix loses its deepest blocks before its root, the order in which the engine's
BlockPool evicts them (a request frees its blocks tail first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tokenloom.core.block_hash import DEFAULT_HASH_ALGO, BlockHash, hash_block_tokens


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple[Any, ...] | None = None,
                        hash_algo: str = DEFAULT_HASH_ALGO) -> list[BlockHash]:
    """The hashes of the prompt's full blocks, exactly as the engine's Request computes them
    (`extra_keys`: the LoRA adapter's, tokenloom.core.request.lora_extra_hash_keys; `hash_algo`: the
    engines' prefix_caching_hash_algo)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(prompt_token_ids[start:start + block_size]), extra_keys,
                                     hash_algo)
        hashes.append(parent)
    return hashes


class EngineBlockLRU:
    """One engine's approximate prefix cache: block hashes, least recently routed first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the router's prefix LRU needs a capacity >= 1 block, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` this engine is believed to hold."""
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, block_hashes: Sequence[BlockHash]) -> None:
        """The engine is about to compute (or reuse) these blocks: make them the most recent."""
        blocks = self._blocks
        for h in reversed(block_hashes[: self.capacity]):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
