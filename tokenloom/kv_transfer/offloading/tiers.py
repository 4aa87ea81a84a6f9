"""The scheduler side's record of what the tiers hold: pure bookkeeping, the bytes live elsewhere.

HostTier: a fixed number of slots in the worker side's host buffer, one block each. An entry is
*pending* from the step that stores it until that step's output comes back (a lookup never counts it
before its bytes are there), then *ready*; ready entries are evicted least recently used first.

DiskTier: entries are files (disk.py), bounded by bytes, least recently used deleted first; the same
pending/ready states. Both order recency with an OrderedDict (oldest first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class HostTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, oldest first
        self._pending: dict[bytes, int] = {}

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._ready or block_hash in self._pending

    def __len__(self) -> int:
        return len(self._ready) + len(self._pending)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of a ready entry (made most recent), else None."""
        slot = self._ready.get(block_hash)
        if slot is not None:
            self._ready.move_to_end(block_hash)
        return slot

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._ready:
            self._ready.move_to_end(block_hash)

    def allocate(self, block_hash: bytes) -> int | None:
        """A slot for a new entry (pending), evicting the least recently used ready one if none is free;
        None when every slot is pending."""
        if self._free:
            slot = self._free.pop()
        elif self._ready:
            _, slot = self._ready.popitem(last=False)
        else:
            return None
        self._pending[block_hash] = slot
        return slot

    def complete(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            slot = self._pending.pop(h, None)
            if slot is not None:
                self._ready[h] = slot

    def abort(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            slot = self._pending.pop(h, None)
            if slot is not None:
                self._free.append(slot)


class DiskTier:
    def __init__(self, capacity_bytes: int, file_bytes: int, existing: Iterable[int] = ()) -> None:
        self.capacity = max(0, capacity_bytes // file_bytes)  # in files
        self._ready: OrderedDict[bytes, None] = OrderedDict((h, None) for h in existing)
        self._pending: set[int] = set()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._ready or block_hash in self._pending

    def __len__(self) -> int:
        return len(self._ready) + len(self._pending)

    def is_ready(self, block_hash: bytes) -> bool:
        return block_hash in self._ready

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._ready:
            self._ready.move_to_end(block_hash)

    def over_capacity(self) -> list[int]:
        """Ready entries to delete (oldest first) so the tier fits its bound (after a restart with less)."""
        out = []
        while len(self) > self.capacity and self._ready:
            out.append(self._ready.popitem(last=False)[0])
        return out

    def reserve(self, block_hash: bytes) -> tuple[bool, list[int]]:
        """Room for a new file (pending): whether there is, and the ready entries evicted for it."""
        if self.capacity == 0:
            return False, []
        evicted = []
        while len(self) >= self.capacity:
            if not self._ready:
                return False, evicted
            evicted.append(self._ready.popitem(last=False)[0])
        self._pending.add(block_hash)
        return True, evicted

    def complete(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self._pending:
                self._pending.discard(h)
                self._ready[h] = None

    def discard(self, block_hash: bytes) -> None:
        """A failed write or a bad file: forget it."""
        self._pending.discard(block_hash)
        self._ready.pop(block_hash, None)
