"""Which scheduler class runs a configuration, and `make_scheduler` (vLLM: SchedulerConfig.get_scheduler_cls);
the scheduler itself is core/scheduler.py.

Build schedulers with `make_scheduler`: the vLLM Scheduler itself (every batching mode: the comparison
modes are a policy it runs, core/batch_policy.py), or for async scheduling vLLM's AsyncScheduler subclass.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.async_scheduler import AsyncScheduler
from tokenloom.core.cost_model import CostModel, load_step_cost_model
from tokenloom.core.scheduler import Scheduler


def scheduler_class(scheduler_config: SchedulerConfig) -> type[Scheduler]:
    if scheduler_config.async_scheduling:
        return AsyncScheduler
    return Scheduler


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    clock: Callable[[], float] = time.monotonic,
    speculative_config: SpeculativeConfig | None = None,
    step_cost_model: CostModel | None = None,
) -> Scheduler:
    """`step_cost_model`: the SLO budget controller's predictor (the simulator hands its own);
    --step-cost-profile, when set, is read instead."""
    if scheduler_config.slo_targets and scheduler_config.step_cost_profile is not None:
        step_cost_model = load_step_cost_model(scheduler_config.step_cost_profile)
    return scheduler_class(scheduler_config)(scheduler_config, cache_config, clock=clock,
                                             speculative_config=speculative_config, step_cost_model=step_cost_model)
