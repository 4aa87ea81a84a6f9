"""make_client: which EngineCoreClient a config gets (vLLM's EngineCoreClient.make_client).

It sits above every client it may pick (core_client.MPClient, dp_client.DPEngineCoreClient, the Ray actors
of ray_engine.py), so the clients never import the factory back: the engine room's modules import one way,
deferred imports included (tests/test_layering.py).
"""

from __future__ import annotations

from dataclasses import replace

from tokenloom.config import EngineConfig, ParallelConfig
from tokenloom.engine.core_client import EngineCoreClient, MPClient
from tokenloom.engine.dp_client import DPEngineCoreClient
from tokenloom.router import RouterConfig


def make_client(config: EngineConfig, log_level: str = "info") -> EngineCoreClient:
    """The engine cores for the API process, as `config.parallel` says: one spawned process (the
    default), N spawned processes behind the router, or N Ray actors behind the router."""
    parallel = config.parallel or ParallelConfig()
    router_config = RouterConfig.from_parallel(parallel)
    config = replace(config, parallel=parallel.engine_local())  # what each engine core runs: one engine
    dp = parallel.data_parallel_size
    if parallel.distributed_executor_backend == "ray":
        from tokenloom.engine.ray_engine import start_ray_engines

        clients, placement = start_ray_engines(config, dp, log_level)
        return DPEngineCoreClient(config, dp, router_config, log_level, clients=clients, on_close=placement.close)
    if dp == 1:
        return MPClient(config, log_level)
    return DPEngineCoreClient(config, dp, router_config, log_level)
