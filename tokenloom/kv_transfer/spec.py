"""KVBlockSpec: what a connector must know of the engine's KV blocks, on both sides (no torch).

`block_nbytes` is the bytes of one block over every per-layer KV tensor the runner holds (K and V, or
whatever a KV dtype adds: values plus scales), as the worker side's block copy lays them out. The
`fingerprint` names everything that decides those bytes (model, weights' quantization, dtype, block
size, KV layout, each tensor's per-block shape and dtype): a block saved under one fingerprint is
never loaded under another (the disk tier checks it across restarts)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KVBlockSpec:
    block_size: int  # tokens per block
    block_nbytes: int  # bytes per block, all KV tensors together
    fingerprint: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> bytes:
        """32 bytes naming the fingerprint (sha256 of its canonical JSON)."""
        return hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).digest()
