"""SharedStorageConnector: prefill/decode hand-off through a directory both engines see, with vLLM's
disaggregated-serving request flow (`kv_transfer_params`, NixlConnector's field names).

vLLM's SharedStorageConnector (now ExampleConnector) hands KV from a prefill engine to a decode engine
through files under `kv_connector_extra_config.shared_storage_path`; this one keeps that key, writes the
disk tier's files (one per block hash, atomic, checksummed: offloading/disk.py) and follows the request
flow of vLLM's disaggregated proxy (tokenloom/server/pd_proxy.py). On one machine put the directory on
/dev/shm: the transport is then shared memory (two machines: a shared filesystem).

  1. proxy -> prefill engine (kv_role kv_producer): the request with max_tokens 1 and kv_transfer_params
     {"do_remote_decode": true}. Each full block the engine computes for it is written to the directory
     after the forward of the step that computes it; when the request finishes, `request_finished`
     returns {"do_remote_prefill": true, "remote_engine_id", "remote_block_ids", "remote_host",
     "remote_port", "remote_storage_path"}, which the response carries. No block is held back: the files
     are complete when the response leaves (so a decode engine that dies holds nothing of the prefill's).
  2. proxy -> decode engine (kv_role kv_consumer): the request with those kv_transfer_params.
     `get_num_new_matched_tokens` reads and checks the files of the request's own block hashes (a file
     missing, cut short or corrupt ends the hit there: those tokens are computed), and the worker side
     loads them into the allocated blocks before the first forward (synchronously: the files are local).
     With `load_async` (kv_connector_extra_config) the lookup only counts the files present and the
     request waits in WAITING_FOR_REMOTE_KVS while the worker side reads, checks and copies them on a
     thread (background_load.py); a file that turns out bad is reported in invalid_block_ids and those
     tokens are recomputed (kv_load_failure_policy "recompute", the default) or the request fails ("fail").

The producer owns the directory (lock, fingerprinted index: the consumer loads nothing unless the index
names its own fingerprint) and bounds it (`shared_storage_bytes`, least recently written deleted first).
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenloom.config import ConfigError, KVTransferConfig
from tokenloom.core.outputs import KVConnectorOutput
from tokenloom.kv_transfer.background_load import load_async_option
from tokenloom.kv_transfer.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    track_block_ids,
    write_block_files,
)
from tokenloom.kv_transfer.offloading.disk import INDEX, DiskFiles, lock_dir, open_dir
from tokenloom.kv_transfer.offloading.tiers import DiskTier
from tokenloom.kv_transfer.spec import KVBlockSpec

if TYPE_CHECKING:
    from tokenloom.core.kv_cache_manager import KVCacheBlocks
    from tokenloom.core.outputs import SchedulerOutput
    from tokenloom.core.request import Request

logger = logging.getLogger(__name__)


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    step_id: int
    load: list[tuple[int, bytearray]] = field(default_factory=list)  # (pool block, the block's bytes)
    store: list[tuple[int, bytes]] = field(default_factory=list)  # (pool block, block hash)
    # Background loads (load_async), by request: (pool block, block hash, None: no host slot here)
    load_async: dict[str, list[tuple[int, int, None]]] = field(default_factory=dict)


class SharedStorageConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, spec: KVBlockSpec) -> None:
        super().__init__(config, role)
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - {"shared_storage_path", "shared_storage_bytes", "load_async"})
        if unknown:
            raise ConfigError(f"SharedStorageConnector: unknown kv_connector_extra_config key(s) {', '.join(unknown)}")
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ConfigError("SharedStorageConnector needs kv_connector_extra_config.shared_storage_path (a "
                              "directory both engines see, e.g. under /dev/shm)")
        size = extra.get("shared_storage_bytes", 4 << 30)
        if isinstance(size, bool) or not isinstance(size, int | float) or size < spec.block_nbytes:
            raise ConfigError(f"SharedStorageConnector: shared_storage_bytes must hold one block of "
                              f"{spec.block_nbytes} bytes, got {size!r}")
        self.spec = spec
        self.block_size = spec.block_size
        self.load_async = load_async_option(config, "SharedStorageConnector")
        self.engine_id = config.engine_id or "tokenloom"
        self.files = DiskFiles(Path(path), spec.digest, spec.block_nbytes)
        self.is_producer = config.is_kv_producer
        self.is_consumer = config.is_kv_consumer
        self._lock_fd: int | None = None
        if role is KVConnectorRole.SCHEDULER:
            self.written: DiskTier | None = None
            if self.is_producer:
                self._lock_fd = lock_dir(self.files.dir)
                self.written = DiskTier(int(size), self.files.file_bytes, (h for h, _ in open_dir(self.files,
                                                                                              spec.fingerprint)))
            self._index_ok = False
            self._step_ids = itertools.count()
            self._meta = SharedStorageMetadata(step_id=next(self._step_ids))
            self._requests: dict[str, Request] = {}
            self._block_ids: dict[str, list[int]] = {}
            self._next_store: dict[str, int] = {}
            self._lookup: dict[str, tuple[int, dict[bytes, bytearray]]] = {}
            self._pending: dict[int, list[bytes]] = {}  # step -> files written in it
            self.loaded_tokens = 0  # since start, for tests and logs
            self._async_loads: dict[str, set[int]] = {}  # request -> pool blocks loading in the background
            self._load_failed: set[str] = set()  # requests a background load failed for: never looked up again
        else:
            self._copier: Any = None
            self._failed: list[int] = []
            self._loader: Any = None  # BackgroundLoader, with load_async

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        params = request.kv_transfer_params
        return params if isinstance(params, dict) else {}

    # ================================================================== scheduler side
    def _consumer_index_ok(self) -> bool:
        """Whether the directory's index names this engine's fingerprint (read until it does: the prefill
        engine may start after this one)."""
        if not self._index_ok:
            try:
                index = json.loads((self.files.dir / INDEX).read_text())
            except (OSError, ValueError):
                return False
            self._index_ok = index.get("fingerprint") == self.spec.fingerprint
            if not self._index_ok:
                logger.warning("SharedStorageConnector: %s was written by an engine with another model or cache "
                               "options; nothing is loaded from it", self.files.dir)
                self._index_ok = None  # type: ignore[assignment]  # logged once; never loads
        return bool(self._index_ok)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not (self.is_consumer and self._params(request).get("do_remote_prefill")):
            return 0, False
        if request.sampling_params.prompt_logprobs is not None or not self._consumer_index_ok():
            return 0, False
        if request.request_id in self._load_failed:  # its files were bad: computed here
            return 0, False
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        if self.load_async:  # the files that are there; read and checked in the background
            n = 0
            for h in request.block_hashes[start:end]:
                if not self.files.path(h).is_file():
                    break
                n += 1
            self._lookup[request.request_id] = (start, {})
            return n * self.block_size, n > 0
        staged: dict[bytes, bytearray] = {}
        for h in request.block_hashes[start:end]:
            data = self.files.read(h)
            if data is None:
                break
            staged[h] = data
        self._lookup[request.request_id] = (start, staged)
        return len(staged) * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        block_ids = [b.block_id for b in blocks.blocks[0]]
        self._block_ids[rid] = block_ids
        start, staged = self._lookup.pop(rid, (request.num_computed_tokens // self.block_size, {}))
        n = num_external_tokens // self.block_size
        if self.load_async and n:
            loads = [(block_ids[i], request.block_hashes[i], None) for i in range(start, start + n)]
            self._meta.load_async[rid] = loads
            self._async_loads[rid] = {b for b, _, _ in loads}
        else:
            for i in range(start, start + n):
                self._meta.load.append((block_ids[i], staged[request.block_hashes[i]]))
        self.loaded_tokens += num_external_tokens
        # A prefill for a decode engine writes every block of the prompt, the pool's hit included (blocks
        # already in the directory are skipped when stored).
        producing = self.written is not None and self._params(request).get("do_remote_decode")
        self._next_store[rid] = 0 if producing else start + n

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        meta = self._meta
        track_block_ids(self._block_ids, scheduler_output)
        if self.written is not None:
            written: list[int] = []
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                request = self._requests.get(rid)
                if request is None or not self._params(request).get("do_remote_decode"):
                    continue
                num_full = min(request.num_computed_tokens + n, len(request.block_hashes) * self.block_size)
                num_full //= self.block_size
                block_ids = self._block_ids[rid]
                for i in range(self._next_store.get(rid, 0), min(num_full, len(block_ids))):
                    h = request.block_hashes[i]
                    if h in self.written:
                        self.written.touch(h)
                        continue
                    ok, evicted = self.written.reserve(h)
                    for old in evicted:
                        self.files.delete(old)
                    if ok:
                        meta.store.append((block_ids[i], h))
                        written.append(h)
                self._next_store[rid] = max(self._next_store.get(rid, 0), num_full)
            if written:
                self._pending[meta.step_id] = written
        self._meta = SharedStorageMetadata(step_id=next(self._step_ids))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_recving or ():
            loading = self._async_loads.pop(rid, set())
            if loading & connector_output.invalid_block_ids:
                self._load_failed.add(rid)
                self.loaded_tokens -= len(loading & connector_output.invalid_block_ids) * self.block_size
        stats = connector_output.kv_connector_stats or {}
        written = self._pending.pop(stats.get("shared_storage_step", -1), [])
        if self.written is not None and written:
            failed = set(stats.get("write_failed", ()))
            for h in failed:
                self.written.discard(h)
            self.written.complete(h for h in written if h not in failed)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        rid = request.request_id
        for table in (self._requests, self._block_ids, self._next_store, self._lookup):
            table.pop(rid, None)
        self._load_failed.discard(rid)
        if not (self.is_producer and self._params(request).get("do_remote_decode")):
            return False, None
        # The files are whole (written in the steps that computed them): nothing to hold back.
        return False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                       "remote_block_ids": list(block_ids[0]) if block_ids else [], "remote_host": None,
                       "remote_port": None, "remote_storage_path": str(self.files.dir)}

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: list[tuple[Any, ...]]) -> None:
        from tokenloom.kv_transfer.block_copy import KVBlockCopier

        self._copier = KVBlockCopier(list(kv_caches))
        if self.load_async:
            from tokenloom.kv_transfer.background_load import BackgroundLoader

            self._loader = BackgroundLoader(self._copier, self.files, name="kv-pd-load")

    def start_load_kv(self, **kwargs: Any) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, SharedStorageMetadata)
        if meta.load:
            data = torch.stack([torch.frombuffer(d, dtype=torch.uint8) for _, d in meta.load])
            self._copier.scatter([b for b, _ in meta.load], data)
        for rid, loads in meta.load_async.items():
            self._loader.submit(rid, loads)


    def wait_for_save(self) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, SharedStorageMetadata)
        self._failed = []
        if not meta.store:
            return
        rows = torch.empty((len(meta.store), self.spec.block_nbytes), dtype=torch.uint8)
        self._copier.gather([b for b, _ in meta.store], rows)
        write_block_files(self.files, rows, [h for _, h in meta.store], self._failed, "SharedStorageConnector")

    def build_connector_worker_output(self) -> KVConnectorOutput | None:
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageMetadata):
            return None
        finished, invalid = self._loader.take_finished() if self._loader is not None else (set(), set())
        return KVConnectorOutput(finished_recving=finished or None, invalid_block_ids=invalid,
                                 kv_connector_stats={"shared_storage_step": meta.step_id,
                                                     "write_failed": list(self._failed)})

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER and self._loader is not None:
            self._loader.shutdown()
        if self._lock_fd is not None:
            import os

            os.close(self._lock_fd)
            self._lock_fd = None
