"""The engine's KV connector (tokenloom/kv_transfer): its checks against the other options, and its two
sides built over a loaded runner (the scheduler side for the Scheduler, the worker side for the runner).

How it combines (docs/kv_offload.md): speculative decoding and async scheduling work (only verified
tokens' full blocks are saved; loads and saves run inside the runner's step, which keeps step order);
structured outputs and quantized weights work (the weights' quantization is in the fingerprint); data
parallel works with the host tier (each engine its own), and with a disk directory each engine gets a
subdirectory of its own (`dp<rank>`). Refused: prefix caching off (blocks are found by the prefix
cache's hashes), models with hybrid KV cache groups (one block table per group), pooling runners."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenloom.config import CacheConfig, ConfigError, EngineConfig, KVTransferConfig
from tokenloom.core.block_hash import DEFAULT_HASH_ALGO, root_parent_hash
from tokenloom.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from tokenloom.kv_transfer.factory import KVConnectorFactory
from tokenloom.kv_transfer.spec import KVBlockSpec

logger = logging.getLogger(__name__)


def check_kv_transfer(config: EngineConfig) -> None:
    """Refuse what a KV connector does not run with, before the model loads."""
    kv = config.kv_transfer_config
    if kv is None or kv.kv_connector is None:
        return
    assert isinstance(kv, KVTransferConfig)
    KVConnectorFactory.get_connector_class(kv)  # an unknown name fails here
    cache = config.cache or CacheConfig()
    if not cache.enable_prefix_caching:
        raise ConfigError(f"{kv.kv_connector} finds blocks by the prefix cache's block hashes: it needs "
                          "--enable-prefix-caching (drop --no-enable-prefix-caching or the connector)")


def data_parallel_kv_transfer(config: EngineConfig, rank: int, num_prefill_engines: int = 0) -> EngineConfig:
    """Engine `rank` of a data-parallel group: a disk tier in a subdirectory of its own (two engines never
    share a directory: disk.py locks it). With `num_prefill_engines` (prefill/decode hand-off inside the
    group, the router as the proxy) engines [0, N) are the SocketConnector's producers, each on kv_port +
    rank, and the others its consumers."""
    kv = config.kv_transfer_config
    if num_prefill_engines:
        if kv is None or kv.kv_connector != "SocketConnector":
            raise ConfigError("data_parallel_prefill_engines hands the KV from prefill to decode engines over the "
                              "SocketConnector: give --kv-transfer-config '{\"kv_connector\": \"SocketConnector\", "
                              "\"kv_role\": \"kv_both\"}'")
        if rank < num_prefill_engines:
            return replace(config, kv_transfer_config=replace(kv, kv_role="kv_producer", kv_port=kv.kv_port + rank))
        return replace(config, kv_transfer_config=replace(kv, kv_role="kv_consumer"))
    if kv is not None and kv.kv_connector in ("SharedStorageConnector", "SocketConnector") and kv.is_kv_producer:
        # Decode engines find the prefill's blocks by block hash in one place (a directory, a port), which one
        # engine owns.
        where = "shared_storage_path" if kv.kv_connector == "SharedStorageConnector" else "kv_port"
        raise ConfigError(f"{kv.kv_connector}: a prefill engine (kv_producer) runs as one engine core; start "
                          f"one `tokenloom serve` per prefill engine, each with its own {where}")
    if kv is None or "disk_dir" not in kv.kv_connector_extra_config:
        return config
    extra = dict(kv.kv_connector_extra_config, disk_dir=str(Path(kv.kv_connector_extra_config["disk_dir"]) /
                                                         f"dp{rank}"))
    # cache=None: the offloading flags were already turned into this kv_transfer_config.
    cache = (replace(config.cache, kv_offloading_size=None, kv_offloading_backend=None, kv_offloading_dir=None)
             if config.cache else None)
    return replace(config, cache=cache, kv_transfer_config=replace(kv, kv_connector_extra_config=extra))


def kv_block_spec(runner: Any, config: EngineConfig, model_path: Path) -> KVBlockSpec:
    """The runner's KV block geometry and what decides its bytes (the disk tier's fingerprint)."""
    from tokenloom.kv_transfer.block_copy import KVBlockCopier

    copier = KVBlockCopier(runner.kv_cache_block_views())
    try:
        stat = model_path.stat()
        model_file = {"path": str(model_path.resolve()), "bytes": stat.st_size if model_path.is_file() else None}
    except OSError:
        model_file = {"path": str(model_path), "bytes": None}
    mc = runner.model_config
    # The block hash names every block on disk and on the P/D wire: engines (or a restart) under another
    # algorithm or root parent (PYTHONHASHSEED seeds it) must not share blocks, and format 2 (digests)
    # refuses format 1's int-hash directories. The root enters as a digest of it: the fingerprint is
    # written to index.json, and the root of a seeded xxhash is meant to stay private.
    hash_algo = config.cache.prefix_caching_hash_algo if config.cache else DEFAULT_HASH_ALGO
    fingerprint = {
        "format": 2,
        "block_hash": hash_algo,
        "block_hash_root": hashlib.sha256(root_parent_hash(hash_algo)).hexdigest()[:16],
        "model": model_file,
        "architecture": getattr(mc, "architecture", None),
        "num_hidden_layers": mc.num_hidden_layers,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "quantization": config.quantization,
        "block_size": runner.block_size,
        "kv_packed": bool(getattr(runner.attn_backend, "kv_packed", False)),
        "kv_tensors": copier.layout(),
    }
    # hf_overrides / disable_sliding_window change the numbers a block holds (only named when set, so a plain
    # engine's fingerprint, and the directories written under it, stay as they were).
    from tokenloom.model.hf_overrides import ModelOverrides

    hf_overrides = config.hf_overrides if isinstance(config.hf_overrides, dict) else {}
    overrides = ModelOverrides.of(hf_overrides, config.disable_sliding_window)
    if overrides is not None:
        fingerprint.update(overrides.fingerprint())
    return KVBlockSpec(block_size=runner.block_size, block_nbytes=copier.block_nbytes, fingerprint=fingerprint)


def make_kv_connectors(config: EngineConfig, runner: Any, model_path: Path, num_kv_cache_groups: int,
                       runner_type: str) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """(scheduler side, worker side) of the configured connector; the worker side has the runner's KV
    tensors registered (call this on the thread that owns the model)."""
    kv = config.kv_transfer_config
    assert kv is not None and kv.kv_connector is not None
    if num_kv_cache_groups > 1:
        raise ConfigError(f"{kv.kv_connector}: this model mixes sliding-window and full-attention layers (hybrid "
                          "KV cache groups); KV connectors run one group only (try --disable-hybrid-kv-cache-manager)")
    assert runner_type == "generate", "pooling engines refuse KV connectors before loading (check_pooling_engine)"
    spec = kv_block_spec(runner, config, model_path)
    scheduler_side = KVConnectorFactory.create_connector(kv, KVConnectorRole.SCHEDULER, spec)
    try:
        worker_side = KVConnectorFactory.create_connector(kv, KVConnectorRole.WORKER, spec)
        worker_side.register_kv_caches(runner.kv_cache_block_views())
    except BaseException:
        scheduler_side.shutdown()  # its directory lock, so a corrected retry in this process can take it
        raise
    logger.info("KV connector %s (%s): blocks of %d bytes", kv.kv_connector, kv.kv_role, spec.block_nbytes)
    return scheduler_side, worker_side
