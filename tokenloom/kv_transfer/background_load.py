"""Asynchronous KV loads on the worker side: blocks read (files, or a fetch from another engine), checked
and copied into the pool on a background thread while steps run (vLLM's load_kv_async, the
WAITING_FOR_REMOTE_KVS flow).

The scheduler parks a request whose connector said `(n, True)` in WAITING_FOR_REMOTE_KVS with its blocks
allocated and not yet in the prefix cache, so nothing but this thread touches those blocks until the
load is reported done. A step's `start_load_kv` submits the step's new loads; `take_finished` (called by
the connector's `build_connector_worker_output`, every step) returns the requests whose load ended and
the pool blocks that did not load (a file missing, cut short or failing its checksum: never copied), as
vLLM's `finished_recving` and `invalid_block_ids` in the same KVConnectorOutput. The scheduler recomputes
from the first invalid block on (kv_load_failure_policy "recompute") or fails the request ("fail").

One thread: the loads of a step are read in the order they were submitted; the file reads, the crc32
and the copy release the GIL, so a forward runs alongside."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tokenloom.config import ConfigError

if TYPE_CHECKING:
    from tokenloom.config import KVTransferConfig
    from tokenloom.kv_transfer.block_copy import KVBlockCopier
    from tokenloom.kv_transfer.offloading.disk import DiskFiles

logger = logging.getLogger(__name__)

# One block to load: (pool block id, block hash of the file, host-tier slot to keep a copy in or None).
BlockLoad = tuple[int, int, "int | None"]
# Reads the blocks of these hashes: each one's bytes, or None where it is missing or does not check.
BlockReader = Callable[[list[int]], "list[bytearray | None]"]


def load_async_option(config: KVTransferConfig, connector: str) -> bool:
    """kv_connector_extra_config.load_async: whether hits that need a file are loaded in the background.
    Off by default: docs/kv_offload.md has the measurement behind that."""
    value = config.kv_connector_extra_config.get("load_async", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{connector}: kv_connector_extra_config.load_async must be true or false, got {value!r}")
    return value


class BackgroundLoader:
    def __init__(self, copier: KVBlockCopier, files: DiskFiles | None = None, host_buffer: Any = None,
                 name: str = "kv-load"):
        self.copier = copier
        self.files = files  # the default reader's files (a connector that fetches passes its own reader)
        self.host_buffer = host_buffer  # [slots, block bytes] uint8, for loads that also fill a host slot
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._done: queue.SimpleQueue[tuple[str, set[int]]] = queue.SimpleQueue()
        self.num_in_flight = 0

    def submit(self, req_id: str, loads: list[BlockLoad], read: BlockReader | None = None) -> None:
        """Load `loads` for `req_id` in the background, with `read` (default: this loader's files)."""
        self.num_in_flight += 1
        self._pool.submit(self._load, req_id, loads, read or self._read_files)

    def _read_files(self, hashes: list[bytes]) -> list[bytearray | None]:
        assert self.files is not None, "a loader without files needs a reader"
        return [self.files.read(h) for h in hashes]  # None: missing, short, or a bad checksum

    def _load(self, req_id: str, loads: list[BlockLoad], read: BlockReader) -> None:
        import torch

        invalid: set[int] = set()
        try:
            good: list[tuple[int, bytearray, int | None]] = []
            payloads = read([block_hash for _, block_hash, _ in loads])
            for (block_id, _, slot), data in zip(loads, payloads, strict=True):
                if data is None:
                    invalid.add(block_id)
                else:
                    good.append((block_id, data, slot))
            if good:
                rows = torch.stack([torch.frombuffer(d, dtype=torch.uint8) for _, d, _ in good])
                self.copier.scatter([b for b, _, _ in good], rows)
                for row, (_, _, slot) in enumerate(good):
                    if slot is not None and self.host_buffer is not None:
                        self.host_buffer[slot] = rows[row]
        except Exception:  # noqa: BLE001 - a load that fails is recomputed, never served
            logger.exception("KV load for request %s failed; its tokens are recomputed", req_id)
            invalid = {block_id for block_id, _, _ in loads}
        self._done.put((req_id, invalid))

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose load ended since the last call, and the blocks of theirs that did not load."""
        finished: set[str] = set()
        invalid: set[int] = set()
        while True:
            try:
                req_id, bad = self._done.get_nowait()
            except queue.Empty:
                break
            self.num_in_flight -= 1
            finished.add(req_id)
            invalid |= bad
        return finished, invalid

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
