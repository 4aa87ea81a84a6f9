"""Run a workload through the real engine in this process (no HTTP), one configuration at a time.

The driver is the simulator's (`tokenloom.sim.simulate.run_workload`): requests enter at their
arrival times, per-token times give TTFT/ITL/E2E, and the metrics are the bench's. Only the runner
and the clock differ — the real ModelRunner on wall time here, the cost model on virtual time there —
which is what makes the simulator's accuracy measurable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tokenloom.bench.workloads import BenchRequest
from tokenloom.config import SchedulerConfig

_SCHED_KNOBS = {
    "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold",
    "policy", "watermark", "scheduler_reserve_full_isl", "batching",
}  # fmt: skip
_CACHE_KNOBS = {"num_blocks", "enable_prefix_caching"}


def run_on_engine(engine: Any, requests: Sequence[BenchRequest], overrides: dict[str, Any] | None = None,
                  trace: str | None = None, seed: int = 0) -> Any:  # fmt: skip
    """Run `requests` on `engine` (an LLMEngine) with scheduler/cache `overrides`; returns a SimResult."""
    from tokenloom.engine.trace import StepTracer
    from tokenloom.sim.clock import WallClock
    from tokenloom.sim.simulate import run_workload

    overrides = dict(overrides or {})
    if "scheduling_policy" in overrides:
        overrides["policy"] = overrides.pop("scheduling_policy")
    unknown = set(overrides) - _SCHED_KNOBS - _CACHE_KNOBS
    if unknown:
        raise ValueError(f"cannot vary {', '.join(sorted(unknown))} without reloading the model")
    base: SchedulerConfig = engine.scheduler_config
    sched = replace(base, **{k: v for k, v in overrides.items() if k in _SCHED_KNOBS})
    cache = replace(engine.cache_config, **{k: v for k, v in overrides.items() if k in _CACHE_KNOBS})
    clock = WallClock()
    engine.reset_scheduler(sched, cache, clock)
    tracer = StepTracer(trace) if trace else None
    engine.engine_core.tracer = tracer
    try:
        return run_workload(requests, engine.engine_core, clock, seed=seed)
    finally:
        if tracer is not None:
            tracer.close()
            engine.engine_core.tracer = None
