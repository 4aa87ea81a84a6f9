"""Step replay: the scheduler alone, with no model, over a trace. The conformance interface.

Trace:  {"config": {...scheduler and cache knobs...},
         "requests": [{"id", "arrival_step", "prompt_token_ids", "max_tokens", "priority"}]}
Before step k every request with arrival_step == k is added, in list order. Every request that
samples in a step samples token id 7; requests stop by max_tokens (or max_model_len).
Output: one entry per step from step 0 until the last request finishes, idle steps included.
The trace format itself (parsing, validation, the scripts) is core/replay_trace.py, the model-less runner
core/replay_runner.py; this module is the synchronous driver and the entry point; core/replay_async.py
drives the AsyncScheduler.

Speculative decoding (shared/reference/replay-spec-async.md): config `num_speculative_tokens` = K
(n-gram-style: no lookahead slots); per request a `drafts` script (drafts offered after each step
the request was in, capped at K and max_model_len - num_tokens; default [K]) and an `accept` script
(drafts accepted at each verification of real drafts; default [0]), both cycled. Draft tokens are
id 9, sampled ones 7; first-decode padding drafts are always rejected. Each step then records
`spec` {id: [scheduled drafts, accepted]} and `pending_drafts`; the summary `spec_decoding`.
With `"async_scheduling": true` in the config the AsyncScheduler is driven in the call order of
vLLM's batch queue (core/replay_async.py); each step also records `events` and `placeholders`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenloom.core.outputs import SchedulerOutput
from tokenloom.core.replay_runner import (
    DRAFT_TOKEN_ID,
    ReplayRunner,
    admit_arrivals,
    pending_drafts,
    unfinished_ids,
)
from tokenloom.core.replay_trace import ScriptCycle, Trace, TraceRequest, parse_trace
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.core.spec_decode_stats import SpecDecodingStats


@dataclass
class StepRecord:
    step: int
    scheduler_output: SchedulerOutput
    finished: list[str]
    num_free_blocks: int
    spec: dict[str, list[int]] = field(default_factory=dict)
    pending_drafts: dict[str, int] = field(default_factory=dict)
    observed: dict[str, list[int]] | None = None  # async: [drafts, accepted] the update counted
    stalled: list[str] | None = None  # a fixed point: the stuck requests (the replay stops here)


def run_steps(trace: Trace, max_steps: int = 1_000_000) -> Iterator[StepRecord | RequestRejected]:
    """Drive the scheduler over the trace, yielding each step (and each rejection as it happens)."""
    scheduler = make_scheduler(trace.scheduler_config, trace.cache_config, clock=lambda: 0.0,
                               speculative_config=trace.speculative_config)
    k = trace.num_speculative_tokens
    drafts = {r.id: ScriptCycle(r.drafts, k) for r in trace.requests}
    runner = ReplayRunner(scheduler, accept={r.id: ScriptCycle(r.accept, 0) for r in trace.requests})
    by_step: dict[int, list[TraceRequest]] = {}
    for r in trace.requests:
        by_step.setdefault(r.arrival_step, []).append(r)
    last_arrival = max(by_step, default=-1)
    arrival_seq = itertools.count(1)
    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise RuntimeError(f"replay did not finish within {max_steps} steps")
        yield from admit_arrivals(scheduler, by_step.get(step, ()), arrival_seq)
        output = scheduler.schedule()
        runner_output = runner.execute_model(output)
        engine_outputs = scheduler.update_from_output(output, runner_output)
        if k > 0 and not output.is_empty:
            _propose(scheduler, output, drafts, k)
        finished = [o.request_id for o in engine_outputs if o.finished]
        # Nothing scheduled, nobody preempted or finished, no arrival to come: the deterministic
        # scheduler would repeat this step forever (e.g. a prompt over the budget with chunked
        # prefill off). Record it and stop, as the reference harness does (summary.stalled).
        stuck = (output.is_empty and not output.preempted_req_ids and not finished and step >= last_arrival
                 and scheduler.has_unfinished_requests())
        yield StepRecord(step, output, finished, scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                         spec=runner.spec, pending_drafts=pending_drafts(scheduler),
                         stalled=unfinished_ids(scheduler) if stuck else None)
        if stuck:
            return
        step += 1


def _propose(scheduler: Scheduler, output: SchedulerOutput, drafts: dict[str, ScriptCycle], k: int) -> None:
    """The scripted proposer (vLLM's post_step): every request of the batch takes its next value."""
    req_ids = list(output.num_scheduled_tokens)
    lists = []
    for rid in req_ids:
        offered = drafts[rid].next()
        request = scheduler.requests.get(rid)
        room = scheduler.max_model_len - request.num_tokens if request is not None else 0
        lists.append([DRAFT_TOKEN_ID] * max(min(offered, k, room), 0))
    scheduler.update_draft_token_ids(req_ids, lists)


def replay(trace_data: dict[str, Any]) -> dict[str, Any]:
    """Replay a trace (the dict form of TRACE.json) and return the STEPS.json dict."""
    trace = parse_trace(trace_data)
    steps: list[dict[str, Any]] = []
    rejected: list[str] = []
    reasons: dict[str, str] = {}
    num_preempted = 0
    k = trace.num_speculative_tokens
    totals = SpecDecodingStats.new(k)
    per_request: dict[str, dict[str, int]] = {}
    if trace.scheduler_config.async_scheduling:
        from tokenloom.core.replay_async import run_steps_async

        items: Iterator[Any] = run_steps_async(trace)
    else:
        items = run_steps(trace)
    stalled: list[str] | None = None
    for item in items:
        if isinstance(item, RequestRejected):
            rejected.append(item.request_id)  # type: ignore[attr-defined]
            reasons[item.request_id] = str(item)  # type: ignore[attr-defined]
            continue
        out = item.scheduler_output
        num_preempted += len(out.preempted_req_ids) if out is not None else 0
        steps.append(
            {
                "step": item.step,
                "scheduled": dict(out.num_scheduled_tokens) if out is not None else {},
                "preempted": sorted(out.preempted_req_ids) if out is not None else [],
                "finished": item.finished,
                "num_free_blocks": item.num_free_blocks,
                "cached_tokens": dict(out.cached_tokens) if out is not None else {},
            }
        )
        if k > 0:
            steps[-1]["spec"] = item.spec
            steps[-1]["pending_drafts"] = item.pending_drafts
            # vLLM's SpecDecodingStats come from update_from_output: in sync mode that is this
            # step's batch (`spec`); async records what the processed batch's output counted.
            observed = item.spec if item.observed is None else item.observed
            for rid, (d, a) in observed.items():
                totals.observe_draft(d, a)
                counts = per_request.setdefault(rid, {"num_drafts": 0, "num_draft_tokens": 0,
                                                      "num_accepted_tokens": 0})
                counts["num_drafts"] += 1
                counts["num_draft_tokens"] += d
                counts["num_accepted_tokens"] += a
        if out is not None and out.policy_actions:  # an opt-in policy acted (never with vLLM's defaults)
            steps[-1]["policy"] = out.policy_actions
        if item.stalled is not None:
            stalled = item.stalled
        if hasattr(item, "events"):  # async: the batch queue's calls and the in-flight placeholders
            steps[-1]["events"] = item.events
            steps[-1]["placeholders"] = item.placeholders
    total_tokens = sum(sum(s["scheduled"].values()) for s in steps)
    summary: dict[str, Any] = {
        "rejected": rejected,
        "rejection_reasons": reasons,
        "num_steps": len(steps),
        "total_scheduled_tokens": total_tokens,
        "num_preemptions": num_preempted,
        "stalled": stalled is not None,
        "unfinished": stalled or [],
    }
    if k > 0:
        summary.update(
            spec_decoding=totals.to_dict(),
            spec_decoding_requests=per_request,
            num_speculative_tokens=k,
            async_scheduling=trace.async_scheduling,
            vllm_error=None,
        )
    return {"steps": steps, "summary": summary}


def replay_file(trace_path: str | Path, out_path: str | Path | None = None) -> dict[str, Any]:
    data = json.loads(Path(trace_path).read_text())
    result = replay(data)
    if out_path is not None:
        Path(out_path).write_text(json.dumps(result, indent=1))
    return result
