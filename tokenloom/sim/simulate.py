"""Discrete-event simulation of a workload: the real scheduler and EngineCore over a SimulatedExecutor.

The driver (`tokenloom.workload.driver.run_workload`) is shared with the real engine
(benchmarks/scheduler/sim_accuracy.py and `bench throughput|sweep` run it over EngineCore + ModelRunner with a
wall clock); only the runner and the clock differ. A simulation gives the same JSON keys as
`tokenloom bench serve`, and the optional step trace is the engine's (StepTracer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from tokenloom.config import (
    CacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_verification_budget,
    engine_config_from_kwargs,
)
from tokenloom.core.cost_model import CostModel
from tokenloom.core.prompt_fit import resolve_max_model_len, sched_max_len_default
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_host import DEFAULT_CPU_KV_BYTES, check_async_scheduling
from tokenloom.engine.trace import StepTracer
from tokenloom.sim.executor import SimulatedExecutor
from tokenloom.sim.profile import Profile
from tokenloom.workload.clock import VirtualClock
from tokenloom.workload.datasets import BenchRequest
from tokenloom.workload.driver import WorkloadResult, run_workload
from tokenloom.workload.metrics import DEFAULT_PERCENTILES
from tokenloom.workload.progress import Progress


def simulate(
    requests: Sequence[BenchRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    *,
    trace: str | Path | IO[str] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    seed: int = 0,
    speculative_config: SpeculativeConfig | None = None,
    spec_acceptance: float = 0.5,
    controller_cost_model: CostModel | None = None,
    progress: Progress | None = None,
) -> WorkloadResult:
    """`speculative_config`: simulate n-gram drafts, each accepted with probability `spec_acceptance`.
    `controller_cost_model`: what the SLO budget controller predicts with, when not the cost model the
    simulation runs (a wrong or mis-scaled profile: the engine core still reports the simulated step
    times to it, as the real engine reports measured ones)."""
    # What the real engine refuses, the simulator refuses too (it would stall where the engine hangs).
    check_verification_budget(scheduler_config.token_budget_ceiling, speculative_config)
    check_async_scheduling(SimpleNamespace(scheduler=scheduler_config, speculative_config=speculative_config))
    clock = VirtualClock()
    scheduler = make_scheduler(scheduler_config, cache_config, clock=clock, speculative_config=speculative_config,
                               step_cost_model=controller_cost_model or cost_model)
    tracer = StepTracer(trace) if trace is not None else None
    k = speculative_config.num_speculative_tokens if speculative_config is not None else 0
    executor = SimulatedExecutor(cost_model, clock, num_spec_tokens=k or 0, spec_acceptance=spec_acceptance,
                                 max_model_len=scheduler_config.max_model_len, seed=seed,
                                 async_scheduling=scheduler_config.async_scheduling)
    core = EngineCore(scheduler, executor, tracer)
    try:
        return run_workload(requests, core, clock, percentiles=percentiles, seed=seed, progress=progress)
    finally:
        if tracer is not None:
            tracer.close()


def speculative_config_of(engine_kwargs: dict[str, Any]) -> SpeculativeConfig | None:
    """The --speculative-config of a simulation's engine arguments (None: off)."""
    return SpeculativeConfig.from_any(engine_kwargs.get("speculative_config"))


def engine_configs(profile: Profile, engine_kwargs: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig]:
    """The scheduler and cache configs the real engine would build from the same vLLM-style arguments.

    The KV pool must match the engine's, or preemption behaves differently: the default is the engine's
    KV memory (--kv-cache-memory, 2 GiB on CPU) over the profiled model's bytes per block, and the
    default max_model_len is the engine's rule applied to the model's context length.
    """
    kwargs = dict(engine_kwargs)
    kwargs.pop("speculative_config", None)  # speculative_config_of
    kv_memory = kwargs.pop("kv_cache_memory", None) or DEFAULT_CPU_KV_BYTES
    config = engine_config_from_kwargs(**kwargs)
    cache = config.cache or CacheConfig()
    if cache.num_blocks is None:
        if not profile.kv_bytes_per_token:
            raise ValueError("the profile does not say the KV bytes per token; pass --num-blocks")
        # --kv-cache-dtype int8: the engine's block holds values + scales (~2x the blocks of bf16).
        num_blocks = kv_memory // (profile.kv_bytes_per_token_for(cache.cache_dtype) * cache.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_memory} bytes holds no KV block; give it more memory")
        cache = replace(cache, num_blocks=num_blocks)
    assert cache.num_blocks is not None
    # The engine's rule (EngineCoreHost): --max-model-len within the model's context, else the default.
    max_model_len = resolve_max_model_len(config, profile.max_model_len, default=sched_max_len_default(
        config, profile.max_model_len, cache.num_blocks * cache.block_size))
    sched = replace(config.scheduler or SchedulerConfig(), max_model_len=max_model_len)  # re-validates
    return sched, cache
