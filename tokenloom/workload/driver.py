"""The workload driver: feed requests to an EngineCore at their arrival times, step it, measure.

Shared by the simulator (SimulatedRunner on a VirtualClock, tokenloom/sim/simulate.py) and the real
engine in this process (ModelRunner on a WallClock, tokenloom/bench/engine_runs.py and
benchmarks/scheduler/sim_accuracy.py): before each step every request whose arrival time has come is added, as
in the engine's loop, so one that arrives while a step runs waits for the next schedule(); when
nothing is in flight the clock waits for the next arrival (a virtual clock jumps). Per-request
figures come from the scheduler's timestamps and from the time of each output token, recorded here,
reduced to the bench's metrics (metrics.py): a run gives the same JSON keys as `tokenloom bench serve`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected
from tokenloom.sampling_params import SamplingParams
from tokenloom.workload.datasets import DEFAULT_VOCAB_RANGE, BenchRequest
from tokenloom.workload.metrics import DEFAULT_PERCENTILES, RequestRecord, compute_metrics

if TYPE_CHECKING:
    from tokenloom.engine.core import EngineCore
    from tokenloom.workload.progress import Progress

# Consecutive empty steps with work left and no arrival to wait for: the scheduler is stuck.
_MAX_EMPTY_STEPS = 1000


class DriverClock(Protocol):
    def __call__(self) -> float: ...

    def wait_until(self, t: float) -> None: ...


@dataclass
class WorkloadResult:
    """What one run of a workload gave: per-request records, the bench's metrics, step counts."""

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
    return Request(r.id, ids, params, arrival_time=r.arrival_s, priority=r.priority)


def run_workload(
    requests: Sequence[BenchRequest],
    core: EngineCore,
    clock: DriverClock,
    *,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
    seed: int = 0,
    make_request: Callable[[BenchRequest, list[int]], Request] = to_request,
    progress: Progress | None = None,
) -> WorkloadResult:
    """Feed the requests to the engine core at their arrival times and step it until all are done.
    `progress`: told after every step how many requests are done and how many tokens came out."""
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
    num_tokens = 0
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
                num_tokens += len(out.new_token_ids)
        if progress is not None:
            progress.update(done=next_i - scheduler.get_num_unfinished_requests(), tokens=num_tokens)
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
    return WorkloadResult(
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
