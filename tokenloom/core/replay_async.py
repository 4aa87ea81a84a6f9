"""Step replay under async scheduling: vLLM's `EngineCore.step_with_batch_queue` call order.

The order (shared/reference/replay-spec-async.md, "Replay order / Async"), with a batch queue of
depth 2: each step adds its arrivals; if the scheduler has requests (`has_requests()`), it
schedules batch k, computes its runner output at once and queues it (event "schedule"), then
processes the oldest batch j (event "update:j") when the queue is full or batch k scheduled nothing
and nothing is waiting or running; with nothing to schedule it processes the oldest queued batch.
So `schedule()` k sees the outputs of batches <= k-2 only.

The scripted runner samples token 7 for every scheduled request that is not a partial prefill
(`is_prefill_chunk`, set at schedule time: computed < num_tokens + placeholders before the step).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.replay import admit_arrivals
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.core.schedulers import make_scheduler

BATCH_QUEUE_SIZE = 2  # vLLM's max_concurrent_batches with async scheduling and no pipeline parallelism


@dataclass
class AsyncStepRecord:
    step: int
    scheduler_output: SchedulerOutput | None  # None: this step scheduled nothing (update or idle)
    finished: list[str]
    num_free_blocks: int
    events: list[str] = field(default_factory=list)
    placeholders: dict[str, int] = field(default_factory=dict)


def scripted_output(scheduler: Scheduler, scheduler_output: SchedulerOutput, token_id: int) -> ModelRunnerOutput:
    """The replay runner's output for a batch, computed right after its schedule()."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[rid].is_prefill_chunk else [token_id] for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
    )


def run_steps_async(trace, token_id: int, max_steps: int = 1_000_000) -> Iterator[AsyncStepRecord | RequestRejected]:
    """Drive the AsyncScheduler over the trace (a replay.Trace) in the batch queue's call order."""
    scheduler = make_scheduler(trace.scheduler_config, trace.cache_config, clock=lambda: 0.0)
    by_step: dict[int, list] = {}
    for r in trace.requests:
        by_step.setdefault(r.arrival_step, []).append(r)
    last_arrival = max(by_step, default=-1)
    queue: deque[tuple[int, SchedulerOutput, ModelRunnerOutput]] = deque()
    arrival_seq = itertools.count(1)
    step = 0
    while True:
        if step >= max_steps:
            raise RuntimeError(f"replay did not finish within {max_steps} steps")
        yield from admit_arrivals(scheduler, by_step.get(step, ()), arrival_seq)
        if step > last_arrival and not scheduler.has_requests() and not queue:
            return
        events: list[str] = []
        finished: list[str] = []
        output: SchedulerOutput | None = None
        pop = False
        if scheduler.has_requests():
            output = scheduler.schedule()
            queue.append((step, output, scripted_output(scheduler, output, token_id)))
            events.append("schedule")
            pop = len(queue) >= BATCH_QUEUE_SIZE or (output.is_empty and not scheduler.has_unfinished_requests())
        elif queue:
            pop = True
        if pop:
            j, batch, runner_output = queue.popleft()
            engine_outputs = scheduler.update_from_output(batch, runner_output)
            finished = [o.request_id for o in engine_outputs if o.finished]
            events.append(f"update:{j}")
        placeholders = {
            rid: r.num_output_placeholders for rid, r in scheduler.requests.items() if r.num_output_placeholders
        }
        yield AsyncStepRecord(step, output, finished, scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                              events, placeholders)  # fmt: skip
        step += 1
