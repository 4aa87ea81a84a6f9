"""Which scheduler class runs a configuration (vLLM: SchedulerConfig.get_scheduler_cls).

Build schedulers with `make_scheduler`: continuous batching is the vLLM Scheduler itself, the
comparison modes its BatchScheduler subclass, async scheduling vLLM's AsyncScheduler subclass.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.async_scheduler import AsyncScheduler
from tokenloom.core.batch_scheduler import BatchScheduler
from tokenloom.core.scheduler import Scheduler


def scheduler_class(scheduler_config: SchedulerConfig) -> type[Scheduler]:
    if scheduler_config.batching in BatchScheduler.batching_modes:
        return BatchScheduler
    if scheduler_config.async_scheduling:
        return AsyncScheduler
    return Scheduler


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    clock: Callable[[], float] = time.monotonic,
    speculative_config: SpeculativeConfig | None = None,
) -> Scheduler:
    return scheduler_class(scheduler_config)(scheduler_config, cache_config, clock=clock,
                                             speculative_config=speculative_config)
