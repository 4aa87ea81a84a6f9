"""Data-parallel simulation: N simulated engines behind the router, on one virtual timeline.

Each engine is the real Scheduler + EngineCore over a SimulatedRunner with its own VirtualClock (its
local time: where its last step ended). The driver always handles the earliest event first:

- an arrival at t, if no engine with work would start a step before t: the Router (the same code as
  the API server's DP client) picks an engine from the engines' current loads and its prefix LRU;
  an idle engine jumps to t, a busy one gets the request before its next schedule(), as a real
  engine reads its inbox between steps;
- otherwise the step of the busy engine whose clock is earliest.

So the engines overlap in simulated time exactly as independent processes would, and routing can be
studied at 8-64 replicas in seconds. Figures: the bench's metrics over all requests, plus the
prefix-cache hit rate (hit / queried prompt tokens, summed over engines) and each engine's share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenloom.bench.metrics import DEFAULT_PERCENTILES, compute_metrics
from tokenloom.bench.workloads import BenchRequest
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.router import Router, RouterConfig
from tokenloom.sim.clock import VirtualClock
from tokenloom.sim.cost_model import CostModel
from tokenloom.sim.runner import SimulatedRunner
from tokenloom.sim.simulate import SimResult, _record, prompt_token_ids, to_request

_MAX_EMPTY_STEPS = 1000


@dataclass
class DPSimResult(SimResult):
    num_engines: int = 1
    policy: str = ""
    requests_per_engine: list[int] | None = None
    prefix_cache_hit_rate: float = 0.0
    router_decisions: dict[str, int] | None = None  # cache_aware: how each choice was made

    @property
    def engine_shares(self) -> list[float]:
        counts = self.requests_per_engine or []
        total = sum(counts) or 1
        return [c / total for c in counts]


class _SimEngine:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, cost_model: CostModel) -> None:
        self.clock = VirtualClock()
        self.scheduler = Scheduler(sched, cache, clock=self.clock)
        self.core = EngineCore(self.scheduler, SimulatedRunner(cost_model, self.clock))
        self.empty_steps = 0

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()


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
) -> DPSimResult:
    assert cache_config.num_blocks is not None
    wall_start = time.perf_counter()
    router_config = router_config or RouterConfig()
    engines = [_SimEngine(scheduler_config, cache_config, cost_model) for _ in range(data_parallel_size)]
    router = Router(router_config, data_parallel_size, cache_config.block_size, cache_config.num_blocks)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    pending = [requests[i] for i in order]
    ids = prompt_token_ids(pending, seed)
    sim_requests: dict[str, Request] = {}
    token_times: dict[str, list[float]] = {}
    rejected: dict[str, str] = {}
    next_i = 0
    while True:
        busy = [e for e in engines if e.busy]
        if next_i >= len(pending) and not busy:
            break
        t_arrival = pending[next_i].arrival_s if next_i < len(pending) else math.inf
        stepper = min(busy, key=lambda e: e.clock()) if busy else None
        if stepper is None or t_arrival <= stepper.clock():
            br = pending[next_i]
            request = to_request(br, ids[next_i])
            next_i += 1
            for i, e in enumerate(engines):  # the router's view: every engine's state now
                s = e.scheduler
                st = s.make_stats()
                router.update_load(i, st.num_waiting_reqs, st.num_running_reqs, st.kv_cache_usage)
            engine = engines[router.route(br.id, request.prompt_token_ids)]
            if not engine.busy:
                engine.clock.wait_until(br.arrival_s)
            try:
                engine.core.add_request(request)
            except RequestRejected as exc:
                rejected[br.id] = str(exc)
                router.finish(br.id)
                continue
            sim_requests[br.id] = request
            token_times[br.id] = []
            continue
        outputs = stepper.core.step()
        now = stepper.clock()
        for out in outputs:
            if out.new_token_ids:
                token_times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finished:
                router.finish(out.request_id)
        if stepper.core.last_step_tokens:
            stepper.empty_steps = 0
            continue
        stepper.empty_steps += 1
        if next_i < len(pending):
            stepper.clock.wait_until(pending[next_i].arrival_s)
        elif stepper.empty_steps >= _MAX_EMPTY_STEPS:
            raise RuntimeError(f"stuck: an engine has {stepper.scheduler.get_num_unfinished_requests()} requests "
                               "left but scheduled nothing")

    records = [_record(br, sim_requests.get(br.id), token_times.get(br.id), rejected.get(br.id)) for br in requests]
    stats = [e.scheduler.make_stats() for e in engines]
    queries = sum(s.prefix_cache_queries for s in stats)
    decisions = getattr(router.policy, "decisions", None)
    return DPSimResult(
        records=records,
        metrics=compute_metrics(records, percentiles=percentiles),
        num_steps=sum(e.core.num_steps for e in engines),
        num_preemptions=sum(e.scheduler.num_preemptions_total for e in engines),
        wall_seconds=time.perf_counter() - wall_start,
        num_engines=data_parallel_size,
        policy=router_config.policy,
        requests_per_engine=list(router.num_routed),
        prefix_cache_hit_rate=sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0,
        router_decisions=dict(decisions) if decisions else None,
    )


def summary_row(result: DPSimResult) -> dict[str, Any]:
    m = result.metrics
    return {
        "policy": result.policy,
        "engines": result.num_engines,
        "hit_rate": round(result.prefix_cache_hit_rate, 3),
        "ttft_p50_ms": round(m["median_ttft_ms"], 1),
        "ttft_p99_ms": round(m["p99_ttft_ms"], 1),
        "throughput_out_tok_s": round(m["output_throughput"], 1),
        "max_share": round(max(result.engine_shares), 3),
        "failed": m["failed"],
    }
