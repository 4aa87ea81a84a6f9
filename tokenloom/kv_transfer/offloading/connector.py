"""OffloadingConnector: the pool's full blocks kept in a host-memory tier and a disk tier, loaded back
instead of recomputed (vLLM's OffloadingConnector, `--kv-offloading-size` / `--kv-offloading-backend
native`; the disk tier is tokenloom's, after the roadmap of vLLM's kv_offload).

What moves, and when (one step, in the runner; whole-step granularity, docs/kv_offload.md):

  scheduler side                                   worker side (ModelRunner.execute_model)
  get_num_new_matched_tokens: the blocks after     start_load_kv, before the forward:
    the pool's hit found in host (ready) or on       host slot -> pool block; disk bytes (read and
    disk (read and checksummed now, so a bad file    checked at lookup) -> pool block, and a copy
    is never a hit) count as external tokens         into a host slot (promotion)
  update_state_after_alloc: where they go
  build_connector_meta: the loads, and the new     wait_for_save, after the forward:
    full blocks each scheduled request completes     pool block -> host slot, and a file on disk
    this step (store, by block hash)                 (write-through: the disk tier survives a restart)
  update_connector_output: the step's stores are   its report: the step, the disk writes that failed
    ready (lookups count them from now on)

With `load_async` (kv_connector_extra_config) a hit that needs the disk is loaded in the background
instead (vLLM's WAITING_FOR_REMOTE_KVS): the lookup only counts the files it knows are complete, returns
`(n, True)`, and the scheduler parks the request with its blocks allocated; the worker side reads, checks
and copies the files on a thread (background_load.py) and reports the request in `finished_recving`, with
the blocks whose file turned out bad in `invalid_block_ids` (recomputed, the file dropped). Its host hits
are still copied before the step's forward, as a synchronous hit's.

Blocks are keyed by the prefix cache's block hash (tokenloom/core/request.py), which chains the whole
prefix, so a hit is always a prefix of the request. Requests that must compute every prompt row
(prompt_logprobs, pooling) never hit, as with the pool's own prefix cache.
"""

from __future__ import annotations

import itertools
import logging
import os
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
from tokenloom.kv_transfer.offloading.disk import DiskFiles, lock_dir, open_dir
from tokenloom.kv_transfer.offloading.tiers import DiskTier, HostTier
from tokenloom.kv_transfer.spec import KVBlockSpec

if TYPE_CHECKING:
    from tokenloom.core.kv_cache_manager import KVCacheBlocks
    from tokenloom.core.outputs import SchedulerOutput
    from tokenloom.core.request import Request

logger = logging.getLogger(__name__)

# Steps whose output has not come back after this many later steps were built are given up on (a
# failed step never reports): their pending entries are dropped, never served.
_MAX_STEPS_IN_FLIGHT = 4


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    step_id: int
    load_host: list[tuple[int, int]] = field(default_factory=list)  # (pool block, host slot)
    # (pool block, the block's bytes read from disk, host slot to keep a copy in or None)
    load_staged: list[tuple[int, bytearray, int | None]] = field(default_factory=list)
    # Background loads (load_async), by request: (pool block, block hash of the file, host slot or None)
    load_async: dict[str, list[tuple[int, int, int | None]]] = field(default_factory=dict)
    # (pool block, host slot or None, block hash to write to disk or None)
    store: list[tuple[int, int | None, int | None]] = field(default_factory=list)


@dataclass
class OffloadingStats:
    """Since start: tokens loaded per tier, blocks stored, files written / evicted / refused."""

    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    blocks_stored: int = 0
    disk_files_written: int = 0
    disk_files_evicted: int = 0
    disk_write_failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def offloading_sizes(config: KVTransferConfig, spec: KVBlockSpec) -> tuple[int, str | None, int]:
    """(host slots, disk directory or None, disk bytes) from kv_connector_extra_config."""
    extra = config.kv_connector_extra_config
    known = {"cpu_bytes_to_use", "num_cpu_blocks", "disk_dir", "disk_bytes_to_use", "load_async"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"OffloadingConnector: unknown kv_connector_extra_config key(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(known))})")
    def number(key: str, default: int | None = None) -> int:
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"OffloadingConnector: kv_connector_extra_config.{key} must be a number, got {value!r}")
        return int(value)

    if "num_cpu_blocks" in extra:  # vLLM's older spelling
        slots = number("num_cpu_blocks")
    elif "cpu_bytes_to_use" in extra:
        slots = number("cpu_bytes_to_use") // spec.block_nbytes
    else:
        raise ConfigError("OffloadingConnector needs kv_connector_extra_config.cpu_bytes_to_use (or "
                          "--kv-offloading-size GiB)")
    if slots < 1:
        raise ConfigError(f"OffloadingConnector: the host tier must hold at least one block of {spec.block_nbytes} "
                          f"bytes, got {slots} blocks")
    disk_dir = extra.get("disk_dir")
    if disk_dir is not None and not isinstance(disk_dir, str):
        raise ConfigError(f"OffloadingConnector: kv_connector_extra_config.disk_dir must be a path, got {disk_dir!r}")
    disk_bytes = number("disk_bytes_to_use", 8 << 30)
    if disk_dir is not None and disk_bytes < spec.block_nbytes:
        raise ConfigError(f"OffloadingConnector: the disk tier must hold at least one block of {spec.block_nbytes} "
                          "bytes")
    return slots, disk_dir, disk_bytes


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, spec: KVBlockSpec) -> None:
        super().__init__(config, role)
        self.spec = spec
        self.block_size = spec.block_size
        self.num_host_slots, disk_dir, disk_bytes = offloading_sizes(config, spec)
        self.load_async = load_async_option(config, "OffloadingConnector")
        self.disk_files: DiskFiles | None = None
        self._lock_fd: int | None = None
        if disk_dir is not None:
            self.disk_files = DiskFiles(Path(disk_dir), spec.digest, spec.block_nbytes)
        if role is KVConnectorRole.SCHEDULER:
            self._init_scheduler(disk_bytes)
        else:
            self._host_buffer: Any = None
            self._copier: Any = None
            self._failed_writes: list[int] = []
            self._loader: Any = None  # BackgroundLoader, with load_async and a disk tier

    # ================================================================== scheduler side
    def _init_scheduler(self, disk_bytes: int) -> None:
        self.host = HostTier(self.num_host_slots)
        self.disk: DiskTier | None = None
        if self.disk_files is not None:
            self._lock_fd = lock_dir(self.disk_files.dir)  # the scheduler side owns the directory
            existing = open_dir(self.disk_files, self.spec.fingerprint)
            self.disk = DiskTier(disk_bytes, self.disk_files.file_bytes, (h for h, _ in existing))
            for h in self.disk.over_capacity():
                self.disk_files.delete(h)
            logger.info("KV disk tier %s: %d blocks kept from before (bound %d blocks)", self.disk_files.dir,
                        len(self.disk), self.disk.capacity)
        self.stats = OffloadingStats()
        self._step_ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._next_store: dict[str, int] = {}  # first block index not yet offered to the tiers
        self._lookup_start: dict[str, int] = {}  # block index where the last lookup started (the pool's hit)
        self._staged: dict[str, dict[bytes, bytearray]] = {}  # disk reads of waiting requests, by block hash
        self._loads = OffloadingConnectorMetadata(step_id=-1)  # this step's loads so far
        self._in_flight: dict[int, tuple[list[bytes], list[bytes]]] = {}  # step -> (host hashes, disk hashes) pending
        self._async_lookup: set[str] = set()  # requests whose last lookup asked for a background load
        self._async_loads: dict[str, list[tuple[int, int, int | None]]] = {}  # request -> its loads in flight

    def _may_hit(self, request: Request) -> bool:
        return request.pooling_params is None and request.sampling_params.prompt_logprobs is None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._may_hit(request):
            return 0, False
        start = num_computed_tokens // self.block_size
        self._lookup_start[request.request_id] = start
        # At most num_tokens - 1 tokens may be computed: the last one is fed to get the logits.
        end = (request.num_tokens - 1) // self.block_size
        staged = self._staged.get(request.request_id)
        n = 0
        from_disk = False
        for h in request.block_hashes[start:end]:
            if self.host.lookup(h) is not None or (staged is not None and h in staged):
                n += 1
                continue
            if self.load_async and self.disk is not None and self.disk.is_ready(h):
                n += 1  # read and checked in the background; a bad file is recomputed then
                from_disk = True
                continue
            if self.disk is not None and self.disk.is_ready(h):
                assert self.disk_files is not None
                data = self.disk_files.read(h)
                if data is not None:
                    if staged is None:
                        staged = self._staged.setdefault(request.request_id, {})
                    staged[h] = data
                    n += 1
                    continue
                self.disk.discard(h)  # bad or vanished file: never a hit again
            break
        if from_disk:
            self._async_lookup.add(request.request_id)
        else:
            self._async_lookup.discard(request.request_id)
        return n * self.block_size, from_disk

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        block_ids = [b.block_id for b in blocks.blocks[0]]
        self._block_ids[rid] = block_ids
        start = self._lookup_start.pop(rid, request.num_computed_tokens // self.block_size)
        num_ext_blocks = num_external_tokens // self.block_size
        staged = self._staged.pop(rid, {})
        in_background = rid in self._async_lookup and num_ext_blocks > 0
        self._async_lookup.discard(rid)
        promote: list[tuple[int, int, bytearray | None]] = []
        for i in range(start, start + num_ext_blocks):
            h = request.block_hashes[i]
            slot = self.host.lookup(h)
            if slot is not None:
                self._loads.load_host.append((block_ids[i], slot))
                self.stats.host_hit_tokens += self.block_size
            else:
                promote.append((block_ids[i], h, None if in_background else staged[h]))
                if self.disk is not None and self.disk_files is not None:
                    self.disk.touch(h)
                    self.disk_files.touch(h)
                self.stats.disk_hit_tokens += self.block_size
        # Disk hits are copied into the host tier too (after every host hit was touched, so a promotion
        # evicts colder entries first; the worker loads from host slots before it writes any).
        loads_in_background: list[tuple[int, int, int | None]] = []
        for block_id, h, data in promote:
            slot = self.host.allocate(h) if h not in self.host else None
            if data is None:  # read in the background: the slot is ready when the load is reported done
                loads_in_background.append((block_id, h, slot))
                continue
            if slot is not None:
                self._pending_host().append(h)
            self._loads.load_staged.append((block_id, data, slot))
        if loads_in_background:
            self._loads.load_async[rid] = loads_in_background
            self._async_loads[rid] = loads_in_background
        # What this admission already has (pool hit + loads) is not offered for storing again.
        self._next_store[rid] = start + num_ext_blocks

    def _pending_host(self) -> list[int]:
        return self._in_flight.setdefault(self._loads.step_id, ([], []))[0]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        meta = self._loads
        track_block_ids(self._block_ids, scheduler_output)
        host_pending: list[int] = []
        disk_pending: list[int] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None or not self._may_hit(request):
                continue
            # Full blocks of known tokens whose every position is computed by the end of this step.
            num_full = min(request.num_computed_tokens + n, len(request.block_hashes) * self.block_size)
            num_full //= self.block_size
            block_ids = self._block_ids[rid]
            for i in range(self._next_store.get(rid, 0), min(num_full, len(block_ids))):
                h = request.block_hashes[i]
                if h in self.host:
                    self.host.touch(h)
                    continue
                # None when every slot is pending (a host tier smaller than the blocks in flight): the block
                # still goes to disk.
                slot = self.host.allocate(h)
                if slot is not None:
                    host_pending.append(h)
                to_disk = None
                if self.disk is not None and h not in self.disk:
                    ok, evicted = self.disk.reserve(h)
                    for old in evicted:
                        assert self.disk_files is not None
                        self.disk_files.delete(old)
                    self.stats.disk_files_evicted += len(evicted)
                    if ok:
                        to_disk = h
                        disk_pending.append(h)
                if slot is not None or to_disk is not None:
                    meta.store.append((block_ids[i], slot, to_disk))
                    self.stats.blocks_stored += 1
            self._next_store[rid] = max(self._next_store.get(rid, 0), num_full)
        if host_pending or disk_pending:  # (a step with nothing pending may never be executed: no tokens)
            pending = self._in_flight.setdefault(meta.step_id, ([], []))
            pending[0].extend(host_pending)
            pending[1].extend(disk_pending)
        self._drop_lost_steps(meta.step_id)
        self._loads = OffloadingConnectorMetadata(step_id=next(self._step_ids))
        return meta

    def _drop_lost_steps(self, step_id: int) -> None:
        for old in [s for s in self._in_flight if s < step_id - _MAX_STEPS_IN_FLIGHT]:
            host_hashes, disk_hashes = self._in_flight.pop(old)
            self.host.abort(host_hashes)
            for h in disk_hashes:
                if self.disk is not None:
                    self.disk.discard(h)
                if self.disk_files is not None:
                    self.disk_files.delete(h)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_recving or ():
            self._background_load_done(rid, connector_output.invalid_block_ids)
        stats = connector_output.kv_connector_stats or {}
        step = stats.get("offloading_step")
        if step is None or step not in self._in_flight:
            return
        host_hashes, disk_hashes = self._in_flight.pop(step)
        self.host.complete(host_hashes)
        if self.disk is not None:
            failed = set(stats.get("disk_write_failed", ()))
            for h in failed:
                self.disk.discard(h)
            self.disk.complete(h for h in disk_hashes if h not in failed)
            self.stats.disk_files_written += len(disk_hashes) - len(failed)
            self.stats.disk_write_failures += len(failed)

    def _background_load_done(self, rid: str, invalid_block_ids: set[int]) -> None:
        """A background load ended: the host copies of the blocks that loaded are ready; a block that did
        not load has a bad or vanished file, which is never a hit again."""
        loads = self._async_loads.pop(rid, [])
        bad = [i for i, (block_id, _, _) in enumerate(loads) if block_id in invalid_block_ids]
        if bad:
            # The blocks from the first bad one on are recomputed: no hits, and stored again as computed.
            self.stats.disk_hit_tokens -= (len(loads) - bad[0]) * self.block_size
            if rid in self._block_ids:
                first = self._block_ids[rid].index(loads[bad[0]][0])
                self._next_store[rid] = min(self._next_store.get(rid, first), first)
        for block_id, h, slot in loads:
            if block_id in invalid_block_ids:
                if slot is not None:
                    self.host.abort([h])
                if self.disk is not None:
                    self.disk.discard(h)
            else:
                if slot is not None:
                    self.host.complete([h])
                if self.disk is not None and self.disk_files is not None:
                    self.disk.touch(h)
                    self.disk_files.touch(h)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        rid = request.request_id
        for table in (self._requests, self._block_ids, self._next_store, self._lookup_start, self._staged):
            table.pop(rid, None)
        self._async_lookup.discard(rid)
        # (A background load still running keeps its record: the scheduler frees the blocks, and this side
        # settles the host slots, when the worker reports it done.)
        return False, None

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: list[tuple[Any, ...]]) -> None:
        """`kv_caches`: (tensor, block axis) pairs, every tensor a block lives in (the runner's
        kv_cache_block_views)."""
        import torch

        from tokenloom.kv_transfer.block_copy import KVBlockCopier

        self._copier = KVBlockCopier(list(kv_caches))
        if self._copier.block_nbytes != self.spec.block_nbytes:
            raise ValueError(f"the runner's KV blocks are {self._copier.block_nbytes} bytes, the connector was "
                             f"built for {self.spec.block_nbytes}")
        # Pages are mapped as slots are first written, so an unused tier costs no memory.
        self._host_buffer = torch.empty((self.num_host_slots, self.spec.block_nbytes), dtype=torch.uint8)
        if self.load_async and self.disk_files is not None:
            from tokenloom.kv_transfer.background_load import BackgroundLoader

            self._loader = BackgroundLoader(self._copier, self.disk_files, self._host_buffer, name="kv-disk-load")

    def start_load_kv(self, **kwargs: Any) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        if meta.load_host:
            blocks, slots = zip(*meta.load_host)
            self._copier.scatter(list(blocks), self._host_rows(list(slots)))
        if meta.load_staged:
            blocks = [b for b, _, _ in meta.load_staged]
            data = torch.stack([torch.frombuffer(d, dtype=torch.uint8) for _, d, _ in meta.load_staged])
            self._copier.scatter(blocks, data)
            for row, (_, _, slot) in enumerate(meta.load_staged):
                if slot is not None:
                    self._host_buffer[slot] = data[row]
        # After the host loads above: a slot a background load fills is never one they read.
        for rid, loads in meta.load_async.items():
            self._loader.submit(rid, loads)

    def _host_view(self, slots: list[int]) -> Any:
        """The host buffer's rows of `slots` as a view when they are consecutive, else None."""
        if slots and all(b == a + 1 for a, b in zip(slots, slots[1:])):
            return self._host_buffer[slots[0] : slots[0] + len(slots)]
        return None

    def _host_rows(self, slots: list[int]) -> Any:
        view = self._host_view(slots)
        return view if view is not None else self._host_buffer[slots]


    def wait_for_save(self) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        self._failed_writes = []
        if not meta.store:
            return
        blocks = [b for b, _, _ in meta.store]
        slots = [slot for _, slot, _ in meta.store]
        direct = self._host_view(slots) if None not in slots else None
        # Consecutive slots (the usual case: a fresh tier hands them out in order) are gathered straight
        # into the host buffer, saving a copy of the step's blocks.
        rows = direct if direct is not None else torch.empty((len(blocks), self.spec.block_nbytes), dtype=torch.uint8)
        self._copier.gather(blocks, rows)
        to_host = [(row, slot) for row, slot in enumerate(slots) if slot is not None]
        if direct is None and to_host:
            self._host_buffer[[slot for _, slot in to_host]] = rows[[row for row, _ in to_host]]
        to_disk = [key for _, _, key in meta.store]
        if any(key is not None for key in to_disk):
            assert self.disk_files is not None
            write_block_files(self.disk_files, rows, to_disk, self._failed_writes, "KV disk tier")

    def build_connector_worker_output(self) -> KVConnectorOutput | None:
        meta = self._connector_metadata
        if not isinstance(meta, OffloadingConnectorMetadata):
            return None
        finished, invalid = self._loader.take_finished() if self._loader is not None else (set(), set())
        return KVConnectorOutput(finished_recving=finished or None, invalid_block_ids=invalid,
                                 kv_connector_stats={"offloading_step": meta.step_id,
                                                     "disk_write_failed": list(self._failed_writes)})

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER and self._loader is not None:
            self._loader.shutdown()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
