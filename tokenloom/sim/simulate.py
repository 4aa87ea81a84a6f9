"""Discrete-event simulation of a workload: the real scheduler and EngineCore over a SimulatedExecutor.

`run_workload` is the driver, shared with the real engine (benchmarks/sim_accuracy.py runs it over
EngineCore + ModelRunner with a wall clock): before each step every request whose arrival time has
come is added, as in the engine's loop, so one that arrives while a step runs waits for the next
schedule(); when nothing is in flight the clock waits for the next arrival (the virtual clock jumps).
Per-request figures come from the scheduler's timestamps and from the time of each output token,
recorded here, reduced to the bench's metrics (tokenloom.bench.metrics): a simulation gives the same
JSON keys as `tokenloom bench serve`, and the optional step trace is the engine's (StepTracer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from tokenloom.bench.metrics import DEFAULT_PERCENTILES, RequestRecord, compute_metrics
from tokenloom.bench.workloads import DEFAULT_VOCAB_RANGE, BenchRequest
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected
from tokenloom.core.schedulers import make_scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.engine.llm_engine import DEFAULT_CPU_KV_BYTES, engine_config_from_kwargs, sched_max_len_default
from tokenloom.engine.trace import StepTracer
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.clock import VirtualClock
from tokenloom.sim.cost_model import CostModel
from tokenloom.sim.executor import SimulatedExecutor
from tokenloom.sim.profile import Profile

# Consecutive empty steps with work left and no arrival to wait for: the scheduler is stuck.
_MAX_EMPTY_STEPS = 1000


class DriverClock(Protocol):
    def __call__(self) -> float: ...

    def wait_until(self, t: float) -> None: ...


@dataclass
class SimResult:
    records: list[RequestRecord]
    metrics: dict[str, Any]
    num_steps: int
    num_preemptions: int
    wall_seconds: float  # real time the run took


def prompt_token_ids(requests: Sequence[BenchRequest], seed: int = 0) -> list[list[int]]:
    """Token ids for each request: its own when it has them, else `prompt_len` random ids.

    Text prompts (ShareGPT) carry only a length here; random ids give each request a distinct
    prompt, so prefix caching finds no accidental hits between them.
    """
    rng = np.random.default_rng(seed)
    lo, hi = DEFAULT_VOCAB_RANGE
    return [
        list(r.prompt) if isinstance(r.prompt, list) else rng.integers(lo, hi + 1, size=r.prompt_len).tolist()
        for r in requests
    ]


def to_request(r: BenchRequest, ids: list[int]) -> Request:
    """The target output length is max_tokens, made exact by ignore_eos (the simulated token is no
    EOS anyway, and a real model must generate the same lengths for a comparison to mean anything)."""
    params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
    return Request(r.id, ids, params, arrival_time=r.arrival_s)


def simulate(
    requests: Sequence[BenchRequest],
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    *,
    trace: str | Path | IO[str] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    seed: int = 0,
) -> SimResult:
    clock = VirtualClock()
    scheduler = make_scheduler(scheduler_config, cache_config, clock=clock)
    tracer = StepTracer(trace) if trace is not None else None
    core = EngineCore(scheduler, SimulatedExecutor(cost_model, clock), tracer)
    try:
        return run_workload(requests, core, clock, percentiles=percentiles, seed=seed)
    finally:
        if tracer is not None:
            tracer.close()


def run_workload(
    requests: Sequence[BenchRequest],
    core: EngineCore,
    clock: DriverClock,
    *,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    seed: int = 0,
    make_request: Callable[[BenchRequest, list[int]], Request] = to_request,
) -> SimResult:
    """Feed the requests to the engine core at their arrival times and step it until all are done."""
    wall_start = time.perf_counter()
    scheduler = core.scheduler
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)  # stable: ties keep list order
    pending = [requests[i] for i in order]
    ids = prompt_token_ids(pending, seed)
    sim_requests: dict[str, Request] = {}
    token_times: dict[str, list[float]] = {}
    rejected: dict[str, str] = {}
    next_i = 0
    empty_steps = 0
    # Unfinished, not has_requests(): finished ids reach the runner with the next real step, so no
    # empty step is traced at the end or in an idle gap.
    while next_i < len(pending) or scheduler.has_unfinished_requests():
        if not scheduler.has_unfinished_requests():
            clock.wait_until(pending[next_i].arrival_s)  # idle until the next arrival
        now = clock()
        while next_i < len(pending) and pending[next_i].arrival_s <= now:
            br = pending[next_i]
            request = make_request(br, ids[next_i])
            next_i += 1
            try:
                core.add_request(request)
            except RequestRejected as exc:
                rejected[br.id] = str(exc)
                continue
            sim_requests[br.id] = request
            token_times[br.id] = []
        if not scheduler.has_unfinished_requests():
            continue  # everything that arrived was rejected
        outputs = core.step()
        now = clock()
        for out in outputs:
            if out.new_token_ids:
                token_times[out.request_id].extend([now] * len(out.new_token_ids))
        if core.last_step_tokens:
            empty_steps = 0
            continue
        # Nothing could be scheduled: wait for the next arrival, or give up if none will come.
        empty_steps += 1
        if next_i < len(pending):
            clock.wait_until(pending[next_i].arrival_s)
        elif empty_steps >= _MAX_EMPTY_STEPS:
            raise RuntimeError(
                f"stuck: {scheduler.get_num_unfinished_requests()} requests left but nothing was scheduled "
                f"for {empty_steps} steps"
            )

    records = [_record(br, sim_requests.get(br.id), token_times.get(br.id), rejected.get(br.id)) for br in requests]
    return SimResult(
        records=records,
        metrics=compute_metrics(records, percentiles=percentiles),
        num_steps=core.num_steps,
        num_preemptions=scheduler.num_preemptions_total,
        wall_seconds=time.perf_counter() - wall_start,
    )


def _record(br: BenchRequest, request: Request | None, times: list[float] | None, error: str | None) -> RequestRecord:
    """The bench's per-request record, from the scheduler's timestamps and the token times."""
    rec = RequestRecord(id=br.id, prompt_len=br.prompt_len, max_tokens=br.max_tokens, arrival_s=br.arrival_s,
                        send_s=br.arrival_s)  # fmt: skip
    if request is None or not times:
        rec.finish_s = br.arrival_s
        rec.error = error or "never finished"
        return rec
    arrival = br.arrival_s
    rec.prompt_len = request.num_prompt_tokens
    rec.finish_s = request.finished_time if request.finished_time is not None else times[-1]
    rec.ttft_s = times[0] - arrival
    rec.e2e_s = times[-1] - arrival
    rec.itl_s = [b - a for a, b in zip(times, times[1:])]
    rec.output_tokens = len(times)
    if request.first_scheduled_time is not None:
        rec.queue_time_s = request.first_scheduled_time - arrival
    rec.success = True
    return rec


def engine_configs(profile: Profile, engine_kwargs: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig]:
    """The scheduler and cache configs the real engine would build from the same vLLM-style arguments.

    The KV pool must match the engine's, or preemption behaves differently: the default is the engine's
    KV memory (--kv-cache-memory, 2 GiB on CPU) over the profiled model's bytes per block, and the
    default max_model_len is the engine's rule applied to the model's context length.
    """
    kwargs = dict(engine_kwargs)
    kv_memory = kwargs.pop("kv_cache_memory", None) or DEFAULT_CPU_KV_BYTES
    config = engine_config_from_kwargs(**kwargs)
    cache = config.cache or CacheConfig()
    if cache.num_blocks is None:
        if not profile.kv_bytes_per_token:
            raise ValueError("the profile does not say the KV bytes per token; pass --num-blocks")
        num_blocks = kv_memory // (profile.kv_bytes_per_token * cache.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={kv_memory} bytes holds no KV block; give it more memory")
        cache = replace(cache, num_blocks=num_blocks)
    assert cache.num_blocks is not None
    max_model_len = config.max_model_len or sched_max_len_default(
        config, profile.max_model_len, cache.num_blocks * cache.block_size
    )
    sched = replace(config.scheduler or SchedulerConfig(), max_model_len=max_model_len)  # re-validates
    return sched, cache
