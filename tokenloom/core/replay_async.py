"""Step replay under async scheduling: vLLM's `EngineCore.step_with_batch_queue` call order.

The order (shared/reference/replay-spec-async.md, "Replay order / Async"), with a batch queue of
depth 2: each step adds its arrivals; if the scheduler has requests (`has_requests()`), it
schedules batch k, computes its runner output at once and queues it (event "schedule"), then
processes the oldest batch j (event "update:j") when the queue is full or batch k scheduled nothing
and nothing is waiting or running; with nothing to schedule it processes the oldest queued batch.
So `schedule()` k sees the outputs of batches <= k-2 only.

The scripted runner (replay.ReplayRunner) samples token 7 for every scheduled request that is not a
partial prefill (`is_prefill_chunk`, set at schedule time: computed < num_tokens + placeholders
before the step). With speculative decoding (K > 0) there is no proposer: the AsyncScheduler gives
every scheduled request that samples K placeholder drafts at schedule time, and the runner verifies
the ones scheduled with the request's `accept` script ([9] * a + [7]); first-decode padding of a
request admitted in the batch is always rejected. `spec` records that batch's [drafts, accepted] at
schedule time; `observed` what update_from_output counted (vLLM's SpecDecodingStats: late output of
a finished request is dropped and not counted, stale output of a preempted one is).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.replay_runner import ReplayRunner, admit_arrivals, pending_drafts, unfinished_ids
from tokenloom.core.replay_trace import ScriptCycle, Trace
from tokenloom.core.scheduler import RequestRejected
from tokenloom.core.scheduler_factory import make_scheduler

BATCH_QUEUE_SIZE = 2  # vLLM's max_concurrent_batches with async scheduling and no pipeline parallelism


@dataclass
class AsyncStepRecord:
    step: int
    scheduler_output: SchedulerOutput | None  # None: this step scheduled nothing (update or idle)
    finished: list[str]
    num_free_blocks: int
    events: list[str] = field(default_factory=list)
    placeholders: dict[str, int] = field(default_factory=dict)
    spec: dict[str, list[int]] = field(default_factory=dict)  # the batch scheduled in this step
    pending_drafts: dict[str, int] = field(default_factory=dict)
    observed: dict[str, list[int]] = field(default_factory=dict)  # what this step's update counted
    stalled: list[str] | None = None  # a fixed point: the stuck requests (the replay stops here)


def run_steps_async(trace: Trace, max_steps: int = 1_000_000) -> Iterator[AsyncStepRecord | RequestRejected]:
    """Drive the AsyncScheduler over the trace in the batch queue's call order."""
    scheduler = make_scheduler(trace.scheduler_config, trace.cache_config, clock=lambda: 0.0,
                               speculative_config=trace.speculative_config)
    runner = ReplayRunner(scheduler, accept={r.id: ScriptCycle(r.accept, 0) for r in trace.requests})
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
        spec: dict[str, list[int]] = {}
        observed: dict[str, list[int]] = {}
        pop = False
        popped_empty = True
        if scheduler.has_requests():
            output = scheduler.schedule()
            # The batch runs at once, in order (the worker's stream); its output waits in the queue.
            queue.append((step, output, runner.execute_model(output)))
            spec = runner.spec
            events.append("schedule")
            pop = len(queue) >= BATCH_QUEUE_SIZE or (output.is_empty and not scheduler.has_unfinished_requests())
        elif queue:
            pop = True
        if pop:
            j, batch, runner_output = queue.popleft()
            popped_empty = batch.is_empty
            engine_outputs = scheduler.update_from_output(batch, runner_output)
            finished = [o.request_id for o in engine_outputs if o.finished]
            observed = dict(scheduler.spec_decoding_per_request)
            events.append(f"update:{j}")
        placeholders = {
            rid: r.num_output_placeholders for rid, r in scheduler.requests.items() if r.num_output_placeholders
        }
        # A fixed point (as in sync replay): this step scheduled nothing and preempted nobody, the
        # batch it processed (if any) was empty too, so no output is in flight, nothing finished,
        # and no arrival is to come; the next step would be the same.
        stuck = (output is not None and output.is_empty and not output.preempted_req_ids and popped_empty
                 and not finished and step >= last_arrival and scheduler.has_unfinished_requests()
                 and all(b.is_empty for _, b, _ in queue))
        yield AsyncStepRecord(step, output, finished, scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                              events, placeholders, spec, pending_drafts(scheduler), observed,
                              unfinished_ids(scheduler) if stuck else None)  # fmt: skip
        if stuck:
            return
        step += 1
