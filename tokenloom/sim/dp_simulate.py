"""Data-parallel simulation: N simulated engines (each the real scheduler + EngineCore over a
SimulatedExecutor with its own VirtualClock) behind the Router, driven by the DP workload driver
(tokenloom/workload/dp_driver.py) on one virtual timeline."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.cost_model import CostModel
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.router import Router, RouterConfig
from tokenloom.sim.executor import SimulatedExecutor
from tokenloom.workload.clock import VirtualClock
from tokenloom.workload.datasets import BenchRequest
from tokenloom.workload.dp_driver import DPWorkloadResult, run_dp_workload
from tokenloom.workload.metrics import DEFAULT_PERCENTILES


def simulate_dp(
    requests: Sequence[BenchRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    data_parallel_size: int,
    router_config: RouterConfig | None = None,
    *,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    seed: int = 0,
) -> DPWorkloadResult:
    assert cache_config.num_blocks is not None
    clocks = [VirtualClock() for _ in range(data_parallel_size)]
    cores = [EngineCore(make_scheduler(scheduler_config, cache_config, clock=c, step_cost_model=cost_model),
                        SimulatedExecutor(cost_model, c, async_scheduling=scheduler_config.async_scheduling))
             for c in clocks]  # fmt: skip
    router = Router(router_config or RouterConfig(), data_parallel_size, cache_config.block_size,
                    cache_config.num_blocks, hash_algo=cache_config.prefix_caching_hash_algo)
    return run_dp_workload(requests, cores, clocks, router, percentiles=percentiles, seed=seed)
