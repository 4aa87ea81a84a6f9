"""Run a workload through the real engine in this process (no HTTP), one configuration at a time.

The driver is the one the simulator uses (`tokenloom.workload.driver.run_workload`): requests enter at their
arrival times, per-token times give TTFT/ITL/E2E, and the metrics are the bench's. Only the runner
and the clock differ — the real ModelRunner on wall time here, the cost model on virtual time there —
which is what makes the simulator's accuracy measurable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tokenloom.config import SchedulerConfig, engine_arg, split_engine_kwargs
from tokenloom.workload.datasets import BenchRequest


def run_on_engine(engine: Any, requests: Sequence[BenchRequest], overrides: dict[str, Any] | None = None,
                  trace: str | None = None, seed: int = 0, label: str | None = None) -> Any:  # fmt: skip
    """Run `requests` on `engine` (an LLMEngine) with scheduler/cache `overrides`; returns a WorkloadResult.
    `label`: print progress lines under it while the run lasts (tokenloom/workload/progress.py)."""
    from tokenloom.engine.trace import StepTracer
    from tokenloom.workload.clock import WallClock
    from tokenloom.workload.driver import run_workload
    from tokenloom.workload.progress import Progress

    overrides = dict(overrides or {})
    reload = sorted(k for k in overrides if engine_arg(k).reload)
    if reload:
        raise ValueError(f"cannot vary {', '.join(reload)} without reloading the model")
    parts = split_engine_kwargs(overrides)
    base: SchedulerConfig = engine.scheduler_config
    if parts["scheduler"].get("batching", base.batching) != "continuous":
        # The comparison batching modes have no async variant: an engine started with
        # --async-scheduling runs them synchronously (its continuous runs stay async).
        parts["scheduler"].setdefault("async_scheduling", False)
    sched = replace(base, **parts["scheduler"])
    cache = replace(engine.cache_config, **parts["cache"])
    clock = WallClock()
    engine.reset_scheduler(sched, cache, clock)
    tracer = StepTracer(trace) if trace else None
    engine.engine_core.tracer = tracer
    progress = Progress(label, len(requests)) if label else None
    try:
        return run_workload(requests, engine.engine_core, clock, seed=seed, progress=progress)
    finally:
        if progress is not None:
            progress.close()
        if tracer is not None:
            tracer.close()
            engine.engine_core.tracer = None
