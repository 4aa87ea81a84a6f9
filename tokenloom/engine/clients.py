"""make_client: which engine-core client a front end gets (vLLM's EngineCoreClient.make_client).

    multiprocess_mode  asyncio_mode   client                       front end
    False              False          InprocClient                 LLMEngine, one engine core in this process
    True               False          SyncMPClient over one below  LLMEngine over engine processes (LLM with DP)
    True               True           MPClient / DPEngineCoreClient AsyncLLM (the server)
                                      (Ray actors behind the router with --distributed-executor-backend ray)

It sits above every client it may pick (core_client.MPClient, dp_client.DPEngineCoreClient, the Ray actors
of ray_engine.py, inproc_client.InprocClient, sync_mp_client.SyncMPClient), so the clients never import the
factory back: the engine room's modules import one way, deferred imports included (tests/test_layering.py).
The protocols they implement are described in engine/core_client.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from tokenloom.config import EngineConfig, ParallelConfig
from tokenloom.engine.core_client import AsyncEngineCoreClient, MPClient, SyncEngineCoreClient
from tokenloom.engine.dp_client import DPEngineCoreClient
from tokenloom.engine.inproc_client import InprocClient
from tokenloom.engine.sync_mp_client import SyncMPClient
from tokenloom.router import RouterConfig


def needs_engine_processes(config: EngineConfig) -> bool:
    """Whether the config's engine cores must run in processes of their own: several of them (data
    parallelism), or engine cores that the Ray backend places (LLMEngine then runs over SyncMPClient)."""
    parallel = config.parallel
    return parallel is not None and (parallel.data_parallel_size > 1 or (parallel.distributed_executor_backend == "ray"
                                                                         and parallel.model_parallel_size == 1))


def make_client(config: EngineConfig, log_level: str = "info", *, multiprocess_mode: bool = True,
                asyncio_mode: bool = True, clock: Callable[[], float] = time.monotonic,
                start_method: str = "forkserver") -> AsyncEngineCoreClient | SyncEngineCoreClient:  # fmt: skip
    """The client for `config`'s engine cores (the table above). `clock` is the in-process core's
    scheduler clock; engine processes keep time.monotonic (one clock for every process on the machine).
    `start_method`: how engine processes start, "forkserver" or "spawn" (engine/process_start.py)."""
    if not multiprocess_mode:
        if asyncio_mode:
            raise ValueError("an in-process engine core is stepped by its caller (LLMEngine): asyncio_mode needs "
                             "multiprocess_mode (AsyncLLM runs the engine core in a process of its own)")
        if needs_engine_processes(config):
            raise ValueError("data_parallel_size > 1 (or engine cores placed by Ray) runs engine-core processes: "
                             "multiprocess_mode=False is one engine core in this process")
        return InprocClient(config, clock)
    client = _mp_client(config, log_level, start_method)
    return client if asyncio_mode else SyncMPClient(client)


def logits_processors_by_name(specs: list | None) -> list[str] | None:
    """Custom logits processors as "module:Class" names for engine processes, which start fresh interpreters and
    import each one by name (vLLM's engine processes unpickle them the same way). Loaded here first, so that a
    name that does not load, or a class that cannot be found by its name (defined in a function, or in an
    interactive session), is refused before any process starts (ValueError / RuntimeError, vLLM's words)."""
    if not specs:
        return specs
    from tokenloom.sample.logits_processor import _load_logitsprocs_by_fqcns, fqcn_for_another_process

    _load_logitsprocs_by_fqcns(specs)
    return [fqcn_for_another_process(spec) for spec in specs]


def hf_overrides_for_another_process(config: EngineConfig) -> dict:
    """hf_overrides as the dict engine processes apply: a callable (offline only; it may not pickle) is run here,
    once, on the model's Hugging Face config (model/hf_overrides.py), before any process starts."""
    if not callable(config.hf_overrides):
        return config.hf_overrides
    from tokenloom.engine.core_host import resolve_model_overrides
    from tokenloom.model.loader import resolve_model_path

    return resolve_model_overrides(config, resolve_model_path(config.model)).hf_overrides


def _mp_client(config: EngineConfig, log_level: str, start_method: str) -> AsyncEngineCoreClient:
    """The engine cores in processes, as `config.parallel` says: one spawned process (the default), N spawned
    processes behind the router, or N Ray actors behind the router."""
    parallel = config.parallel or ParallelConfig()
    router_config = RouterConfig.from_parallel(parallel)
    config = replace(config, parallel=parallel.engine_local(),  # what each engine core runs: one engine
                     logits_processors=logits_processors_by_name(config.logits_processors),
                     hf_overrides=hf_overrides_for_another_process(config))
    dp = parallel.data_parallel_size
    if parallel.distributed_executor_backend == "ray":
        from tokenloom.engine.ray_engine import start_ray_engines

        clients, placement = start_ray_engines(config, dp, log_level)
        return DPEngineCoreClient(config, dp, router_config, log_level, clients=clients, on_close=placement.close)
    if dp == 1:
        return MPClient(config, log_level, start_method=start_method)
    return DPEngineCoreClient(config, dp, router_config, log_level, start_method=start_method)
