"""Step trace: one JSON line per engine step — what was scheduled, why, and what it cost.

Each record carries the step's intervals (schedule, execute, wait, update: see StepTracer.record),
so a timeline shows how async scheduling overlaps one step's host work with another's execution.

Off by default. When off the engine holds `None` instead of a tracer and pays one `is None` test
per step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from tokenloom.core.outputs import EngineCoreOutput, SchedulerOutput
from tokenloom.core.scheduler import Scheduler


def step_record(
    step: int,
    t_start: float,
    t_end: float,
    scheduler: Scheduler,
    output: SchedulerOutput,
    finished: list[str],
) -> dict[str, Any]:
    """The trace record of one step, read off the scheduler right after update_from_output."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    # The step's budget: max_num_batched_tokens, or less where the SLO budget controller or the automatic
    # budget set it.
    acted = output.policy_actions.get("slo_budget") or output.policy_actions.get("auto_budget") or {}
    budget = acted.get("budget", scheduler.max_num_scheduled_tokens)
    used = output.total_num_scheduled_tokens
    prefill = dict(output.num_prefill_tokens)
    decode = {rid: n for rid, n in output.num_scheduled_tokens.items() if rid not in prefill}
    num_free = pool.get_num_free_blocks()
    record = {
        "step": step,
        "t_start": t_start,
        "t_end": t_end,
        "scheduled": dict(output.num_scheduled_tokens),
        "prefill": prefill,
        # Where each prefill chunk starts (tokens already in the KV cache): a chunk's attention reads
        # prefill_start + its tokens keys per query, so step time against it is prefill cost vs context.
        "prefill_start": _chunk_starts(output, prefill),
        "decode": decode,
        "budget": budget,
        "budget_used": used,
        "budget_left": budget - used,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "kv_blocks_used": kv.num_blocks - num_free,
        "kv_blocks_free": num_free,
        "kv_blocks_cached": pool.get_num_cached_free_blocks(),
        "num_blocks": kv.num_blocks,
        "preempted": sorted(output.preempted_req_ids),
        "finished": finished,
        "cached_tokens": dict(output.cached_tokens),
        "bound_by": output.bound_by,
        # Speculative decoding: {request: [drafts scheduled, drafts accepted]} (empty without).
        "spec": dict(scheduler.spec_decoding_per_request),
    }
    if output.policy_actions:  # only when an opt-in policy acted: default traces stay as they were
        record["policy"] = output.policy_actions
    if output.lora_names:  # LoRA: {request: adapter name} of the step's adapter requests
        record["lora"] = dict(output.lora_names)
    return record


def _chunk_starts(output: SchedulerOutput, prefill: dict[str, int]) -> dict[str, int]:
    starts = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs if r.req_id in prefill}
    cached = output.scheduled_cached_reqs
    starts.update({rid: n for rid, n in zip(cached.req_ids, cached.num_computed_tokens) if rid in prefill})
    return starts


class StepTracer:
    """Writes step records as JSON lines to a file (or any text stream)."""

    def __init__(self, sink: str | Path | IO[str]) -> None:
        if isinstance(sink, str | Path):
            self._file: IO[str] = open(sink, "w")  # noqa: SIM115 - closed in close()
            self._owns = True
        else:
            self._file = sink
            self._owns = False
        self.num_steps = 0

    def record(
        self,
        t_start: float,
        t_end: float,
        scheduler: Scheduler,
        output: SchedulerOutput,
        engine_outputs: list[EngineCoreOutput],
        timing: dict[str, Any] | None = None,
    ) -> None:
        finished = [o.request_id for o in engine_outputs if o.finished]
        rec = step_record(self.num_steps, t_start, t_end, scheduler, output, finished)
        if timing:
            # The step's intervals: schedule [t_start, t_scheduled], execute [t_exec_start, t_exec_end]
            # (in the worker thread under async scheduling, overlapping the next step's schedule),
            # wait for the output [t_wait, t_update], update [t_update, t_end]; `in_flight`: steps
            # still executing when this one was processed.
            rec.update(timing)
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.num_steps += 1

    def close(self) -> None:
        self._file.flush()
        if self._owns:
            self._file.close()
