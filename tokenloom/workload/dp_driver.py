"""The data-parallel workload driver: N engine cores behind the Router, on one timeline.

Each engine core has its own clock (its local time: where its last step ended); the driver always
handles the earliest event first:

- an arrival at t, if no engine with work would start a step before t: the Router (the same code as
  the API server's DP client, tokenloom/router) picks an engine from the engines' current loads and
  its prefix LRU; an idle engine waits until t, a busy one gets the request before its next
  schedule(), as a real engine reads its inbox between steps;
- otherwise the step of the busy engine whose clock is earliest.

So engines overlap in time exactly as independent processes would. With simulated engines
(tokenloom/sim/dp_simulate.py) this studies routing at 8-64 replicas in seconds. Figures: the bench's
metrics over all requests, the prefix-cache hit rate (hit / queried prompt tokens over all engines)
and each engine's share of the requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected
from tokenloom.router import Router
from tokenloom.workload.datasets import BenchRequest
from tokenloom.workload.driver import (
    _MAX_EMPTY_STEPS,
    DriverClock,
    WorkloadResult,
    _record,
    prompt_token_ids,
    to_request,
)
from tokenloom.workload.metrics import DEFAULT_PERCENTILES, compute_metrics

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore


@dataclass
class DPWorkloadResult(WorkloadResult):
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


def run_dp_workload(
    requests: Sequence[BenchRequest],
    cores: Sequence[EngineCore],
    clocks: Sequence[DriverClock],
    router: Router,
    *,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    seed: int = 0,
) -> DPWorkloadResult:
    """Route each request at its arrival time and step the engines in time order until all are done."""
    wall_start = time.perf_counter()
    n = len(cores)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    pending = [requests[i] for i in order]
    ids = prompt_token_ids(pending, seed)
    sim_requests: dict[str, Request] = {}
    token_times: dict[str, list[float]] = {}
    rejected: dict[str, str] = {}
    empty_steps = [0] * n
    next_i = 0
    while True:
        busy = [i for i in range(n) if cores[i].scheduler.has_unfinished_requests()]
        if next_i >= len(pending) and not busy:
            break
        t_arrival = pending[next_i].arrival_s if next_i < len(pending) else math.inf
        stepper = min(busy, key=lambda i: (clocks[i](), i)) if busy else None
        if stepper is None or t_arrival <= clocks[stepper]():
            br = pending[next_i]
            request = to_request(br, ids[next_i])
            next_i += 1
            for i, core in enumerate(cores):  # the router's view: every engine's state now
                st = core.scheduler.make_stats()
                router.update_load(i, st.num_waiting_reqs, st.num_running_reqs, st.kv_cache_usage)
            e = router.route(br.id, request.prompt_token_ids)
            if not cores[e].scheduler.has_unfinished_requests():
                clocks[e].wait_until(br.arrival_s)
            try:
                cores[e].add_request(request)
            except RequestRejected as exc:
                rejected[br.id] = str(exc)
                router.finish(br.id)
                continue
            sim_requests[br.id] = request
            token_times[br.id] = []
            continue
        core = cores[stepper]
        outputs = core.step()
        now = clocks[stepper]()
        for out in outputs:
            if out.new_token_ids:
                token_times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finished:
                router.finish(out.request_id)
        if core.last_step_tokens:
            empty_steps[stepper] = 0
            continue
        # Nothing could be scheduled on this engine: wait for the next arrival, or give up.
        empty_steps[stepper] += 1
        if next_i < len(pending):
            clocks[stepper].wait_until(pending[next_i].arrival_s)
        elif empty_steps[stepper] >= _MAX_EMPTY_STEPS:
            raise RuntimeError(f"stuck: engine {stepper} has {core.scheduler.get_num_unfinished_requests()} "
                               "requests left but scheduled nothing")

    records = [_record(br, sim_requests.get(br.id), token_times.get(br.id), rejected.get(br.id)) for br in requests]
    stats = [core.scheduler.make_stats() for core in cores]
    queries = sum(s.prefix_cache_queries for s in stats)
    decisions = getattr(router.policy, "decisions", None)
    return DPWorkloadResult(
        records=records,
        metrics=compute_metrics(records, percentiles=percentiles),
        num_steps=sum(core.num_steps for core in cores),
        num_preemptions=sum(core.scheduler.num_preemptions_total for core in cores),
        wall_seconds=time.perf_counter() - wall_start,
        num_engines=n,
        policy=router.config.policy,
        requests_per_engine=list(router.num_routed),
        prefix_cache_hit_rate=sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0,
        router_decisions=dict(decisions) if decisions else None,
    )


def summary_row(result: DPWorkloadResult) -> dict[str, Any]:
    m = result.metrics
    return {
        "policy": result.policy,
        "engines": result.num_engines,
        "hit_rate": round(result.prefix_cache_hit_rate, 3),
        "ttft_p50_ms": round(m["median_ttft_ms"], 1),
        "ttft_p99_ms": round(m["p99_ttft_ms"], 1),
        "output_tok_s": round(m["output_throughput"], 1),
        "max_share": round(max(result.engine_shares), 3),
        "failed": m["failed"],
    }
