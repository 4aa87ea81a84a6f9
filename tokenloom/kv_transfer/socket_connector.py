"""SocketConnector: prefill/decode hand-off over TCP, with vLLM's disaggregated-serving request flow
(`kv_transfer_params`, NixlConnector's field names: the decode side reads from `remote_host:remote_port`).

The SharedStorageConnector needs a directory both engines see; this one needs only a TCP route from the
decode engine to the prefill engine (NIXL's role in vLLM, over a plain socket: socket_transport.py).

  1. proxy -> prefill engine (kv_role kv_producer; it listens on kv_ip:kv_port): the request with
     max_tokens 1 and kv_transfer_params {"do_remote_decode": true}. Each full block the engine computes
     for it is copied, after the forward of the step that computes it, into a bounded host-memory store
     keyed by block hash (`send_buffer_bytes`, least recently used dropped first). When the request
     finishes `request_finished` returns {"do_remote_prefill": true, "remote_engine_id",
     "remote_block_ids", "remote_host", "remote_port"}: the response carries them. The pool's blocks are
     freed at once (delay_free False): the store holds copies, so nothing waits on a decode engine, and
     a decode engine that dies or never asks holds nothing of the prefill engine's pool.
  2. proxy -> decode engine (kv_role kv_consumer): the request with those kv_transfer_params.
     `get_num_new_matched_tokens` fetches the request's own block hashes (after the pool's hit) from
     remote_host:remote_port in one exchange and keeps the prefix whose hashes and crc32 check; the
     worker side copies them into the allocated blocks before the first forward, so the decode engine
     computes only the last prompt token. A prefill engine that cannot be reached, answers with another
     fingerprint, or sends a bad block costs only the tokens from there on: they are computed.

With `load_async` (kv_connector_extra_config) the decode engine does not wait for the fetch at lookup:
it counts every full block of the prompt (vLLM's NIXL counts the remote blocks the same way), parks the
request in WAITING_FOR_REMOTE_KVS and fetches on the worker side's thread (background_load.py); the
blocks that did not come are reported invalid and computed (kv_load_failure_policy "recompute"), or
the request fails ("fail").
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.config import ConfigError, KVTransferConfig
from tokenloom.core.outputs import KVConnectorOutput
from tokenloom.kv_transfer.background_load import load_async_option
from tokenloom.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, track_block_ids
from tokenloom.kv_transfer.socket_transport import BlockServer, BlockStore, fetch_blocks
from tokenloom.kv_transfer.spec import KVBlockSpec

if TYPE_CHECKING:
    from tokenloom.core.kv_cache_manager import KVCacheBlocks
    from tokenloom.core.outputs import SchedulerOutput
    from tokenloom.core.request import Request

logger = logging.getLogger(__name__)

_KNOWN_KEYS = {"send_buffer_bytes", "fetch_timeout_s", "load_async"}


@dataclass
class SocketConnectorMetadata(KVConnectorMetadata):
    step_id: int
    load: list[tuple[int, bytearray]] = field(default_factory=list)  # (pool block, the block's bytes)
    store: list[tuple[int, bytes]] = field(default_factory=list)  # (pool block, block hash)
    # Background fetches (load_async), by request: ((host, port), [(pool block, block hash, None)])
    load_async: dict[str, tuple[tuple[str, int], list[tuple[int, int, None]]]] = field(default_factory=dict)


def _number(extra: dict[str, Any], key: str, default: float, minimum: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ConfigError(f"SocketConnector: kv_connector_extra_config.{key} must be a number >= {minimum}, "
                          f"got {value!r}")
    return value


class SocketConnector(KVConnectorBase_V1):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, spec: KVBlockSpec) -> None:
        super().__init__(config, role)
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"SocketConnector: unknown kv_connector_extra_config key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(_KNOWN_KEYS))})")
        self.send_buffer_bytes = int(_number(extra, "send_buffer_bytes", 2 << 30, spec.block_nbytes))
        self.fetch_timeout_s = float(_number(extra, "fetch_timeout_s", 30.0, 0.001))
        self.load_async = load_async_option(config, "SocketConnector")
        self.is_producer = config.is_kv_producer
        self.is_consumer = config.is_kv_consumer
        if self.is_producer and not 0 < config.kv_port < 65536:
            raise ConfigError(f"SocketConnector: a prefill engine (kv_producer) listens on kv_port, which must be a "
                              f"port number (1-65535), got {config.kv_port}")
        self.spec = spec
        self.block_size = spec.block_size
        self.engine_id = config.engine_id or "tokenloom"
        if role is KVConnectorRole.SCHEDULER:
            self._step_ids = itertools.count()
            self._meta = SocketConnectorMetadata(step_id=next(self._step_ids))
            self._requests: dict[str, Request] = {}
            self._block_ids: dict[str, list[int]] = {}
            self._next_store: dict[str, int] = {}
            self._fetched: dict[str, tuple[int, list[bytearray]]] = {}  # request -> (first block, payloads)
            self.loaded_tokens = 0  # since start, for tests and logs
            self._async_loads: dict[str, set[int]] = {}  # request -> pool blocks fetched in the background
            self._load_failed: set[str] = set()  # a background fetch failed: the prompt is computed here
        else:
            self._copier: Any = None
            self.store: BlockStore | None = None
            self.server: BlockServer | None = None
            self._loader: Any = None  # BackgroundLoader, with load_async

    @staticmethod
    def _params(request: Request) -> dict[str, Any]:
        params = request.kv_transfer_params
        return params if isinstance(params, dict) else {}

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._params(request)
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return 0, False
        if request.sampling_params.prompt_logprobs is not None:  # computes every prompt row anyway
            return 0, False
        rid = request.request_id
        start = num_computed_tokens // self.block_size
        if rid in self._load_failed:
            return 0, False
        if self.load_async:
            if self._remote(request, params) is None:
                return 0, False
            n = max(0, (request.num_tokens - 1) // self.block_size - start)  # fetched in the background
            return n * self.block_size, n > 0
        cached = self._fetched.get(rid)
        if cached is None or cached[0] != start:  # fetched once per admission attempt's starting block
            cached = (start, self._fetch(request, params, start))
            self._fetched[rid] = cached
        return len(cached[1]) * self.block_size, False

    @staticmethod
    def _remote(request: Request, params: dict[str, Any]) -> tuple[str, int] | None:
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            logger.warning("SocketConnector: request %s has do_remote_prefill without remote_host / remote_port; "
                           "its prompt is computed here", request.request_id)
            return None
        return host, port

    def _fetch(self, request: Request, params: dict[str, Any], start: int) -> list[bytearray]:
        remote = self._remote(request, params)
        if remote is None:
            return []
        host, port = remote
        end = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        hashes = list(request.block_hashes[start:end])
        if not hashes:
            return []
        try:
            return fetch_blocks(host, port, self.spec.digest, hashes, self.spec.block_nbytes, self.fetch_timeout_s)
        except (OSError, ConnectionError, ValueError) as exc:
            logger.warning("SocketConnector: no KV from the prefill engine at %s:%s for request %s (%s); its prompt "
                           "is computed here", host, port, request.request_id, exc)
            return []

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request
        block_ids = [b.block_id for b in blocks.blocks[0]]
        self._block_ids[rid] = block_ids
        start, payloads = self._fetched.pop(rid, (request.num_computed_tokens // self.block_size, []))
        n = num_external_tokens // self.block_size
        if self.load_async and n:
            remote = self._remote(request, self._params(request))
            assert remote is not None  # the lookup said so
            loads = [(block_ids[i], request.block_hashes[i], None) for i in range(start, start + n)]
            self._meta.load_async[rid] = (remote, loads)
            self._async_loads[rid] = {b for b, _, _ in loads}
        for i in range(n if not self.load_async else 0):
            self._meta.load.append((block_ids[start + i], payloads[i]))
        self.loaded_tokens += num_external_tokens
        # A prefill for a decode engine sends every block of the prompt, the pool's hit included.
        producing = self.is_producer and self._params(request).get("do_remote_decode")
        self._next_store[rid] = 0 if producing else start + n

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SocketConnectorMetadata:
        meta = self._meta
        track_block_ids(self._block_ids, scheduler_output)
        if self.is_producer:
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                request = self._requests.get(rid)
                if request is None or not self._params(request).get("do_remote_decode"):
                    continue
                # Full blocks of known tokens whose every position is computed by the end of this step.
                num_full = min(request.num_computed_tokens + n, len(request.block_hashes) * self.block_size)
                num_full //= self.block_size
                block_ids = self._block_ids[rid]
                for i in range(self._next_store.get(rid, 0), min(num_full, len(block_ids))):
                    meta.store.append((block_ids[i], request.block_hashes[i]))
                self._next_store[rid] = max(self._next_store.get(rid, 0), num_full)
        self._meta = SocketConnectorMetadata(step_id=next(self._step_ids))
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_recving or ():
            loading = self._async_loads.pop(rid, set())
            if loading & connector_output.invalid_block_ids:
                self._load_failed.add(rid)  # computed from the first missing block on; never fetched again
                self.loaded_tokens -= len(loading & connector_output.invalid_block_ids) * self.block_size

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        rid = request.request_id
        for table in (self._requests, self._block_ids, self._next_store, self._fetched):
            table.pop(rid, None)
        self._load_failed.discard(rid)
        if not (self.is_producer and self._params(request).get("do_remote_decode")):
            return False, None
        # The store holds copies of the blocks (made in the steps that computed them): nothing to hold back.
        return False, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                       "remote_block_ids": list(block_ids[0]) if block_ids else [],
                       "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port}

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: list[tuple[Any, ...]]) -> None:
        from tokenloom.kv_transfer.block_copy import KVBlockCopier

        self._copier = KVBlockCopier(list(kv_caches))
        if self.load_async and self.is_consumer:
            from tokenloom.kv_transfer.background_load import BackgroundLoader

            self._loader = BackgroundLoader(self._copier, name="kv-socket-fetch")
        if self.is_producer:
            self.store = BlockStore(self.send_buffer_bytes, self.spec.block_nbytes)
            self.server = BlockServer(self.store, self.spec.digest, self.config.kv_ip, self.config.kv_port)
            logger.info("SocketConnector: serving KV blocks on %s:%d (%d blocks at most)", *self.server.address,
                        self.store.capacity)

    def start_load_kv(self, **kwargs: Any) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, SocketConnectorMetadata)
        if meta.load:
            data = torch.stack([torch.frombuffer(d, dtype=torch.uint8) for _, d in meta.load])
            self._copier.scatter([b for b, _ in meta.load], data)
        for rid, ((host, port), loads) in meta.load_async.items():
            self._loader.submit(rid, loads, self._reader(rid, host, port))

    def _reader(self, rid: str, host: str, port: int) -> Any:
        """Fetches a request's blocks from the prefill engine: the prefix that came, None for the rest."""
        def read(hashes: list[bytes]) -> list[bytearray | None]:
            try:
                got: list[bytearray | None] = list(fetch_blocks(host, port, self.spec.digest, hashes,
                                                                self.spec.block_nbytes, self.fetch_timeout_s))
            except (OSError, ConnectionError, ValueError) as exc:
                logger.warning("SocketConnector: no KV from the prefill engine at %s:%s for request %s (%s); its "
                               "prompt is computed here", host, port, rid, exc)
                got = []
            return got + [None] * (len(hashes) - len(got))
        return read


    def wait_for_save(self) -> None:
        import torch

        meta = self._get_connector_metadata()
        assert isinstance(meta, SocketConnectorMetadata)
        if not meta.store or self.store is None:
            return
        todo = [(b, h) for b, h in meta.store if h not in self.store]
        if not todo:
            return
        rows = torch.empty((len(todo), self.spec.block_nbytes), dtype=torch.uint8)
        self._copier.gather([b for b, _ in todo], rows)
        for row, (_, h) in enumerate(todo):
            self.store.put(h, rows[row].numpy().tobytes())

    def build_connector_worker_output(self) -> KVConnectorOutput | None:
        if self._loader is None:
            return None
        finished, invalid = self._loader.take_finished()
        return KVConnectorOutput(finished_recving=finished or None, invalid_block_ids=invalid)

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.WORKER:
            if self.server is not None:
                self.server.close()
                self.server = None
            if self._loader is not None:
                self._loader.shutdown()
