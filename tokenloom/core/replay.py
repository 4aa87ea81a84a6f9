"""Step replay: the scheduler alone, with no model, over a trace. The conformance interface.

Trace:  {"config": {...scheduler and cache knobs...},
         "requests": [{"id", "arrival_step", "prompt_token_ids", "max_tokens", "priority"}]}
Before step k every request with arrival_step == k is added, in list order. Every request that
samples in a step samples token id 7; requests stop by max_tokens (or max_model_len).
Output: one entry per step from step 0 until the last request finishes, idle steps included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.core.schedulers import make_scheduler
from tokenloom.sampling_params import SamplingParams

REPLAY_TOKEN_ID = 7

# A trace's "config" holds SchedulerConfig and CacheConfig fields by their field names.
_SCHEDULER_KEYS = {f.name for f in fields(SchedulerConfig)}
_CACHE_KEYS = {f.name for f in fields(CacheConfig)}


@dataclass
class TraceRequest:
    id: str
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0


@dataclass
class Trace:
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: list[TraceRequest] = field(default_factory=list)


def parse_trace(data: dict[str, Any]) -> Trace:
    if not isinstance(data, dict) or "config" not in data or "requests" not in data:
        raise ConfigError('a trace is a JSON object with "config" and "requests"')
    config = dict(data["config"])
    unknown = sorted(set(config) - _SCHEDULER_KEYS - _CACHE_KEYS)
    if unknown:
        raise ConfigError(f"unknown config key(s) in trace: {', '.join(unknown)}")
    if "num_blocks" not in config:
        raise ConfigError("trace config needs num_blocks (usable KV blocks in the pool)")
    sched = SchedulerConfig(**{k: v for k, v in config.items() if k in _SCHEDULER_KEYS})
    cache = CacheConfig(**{k: v for k, v in config.items() if k in _CACHE_KEYS})
    requests = []
    for i, r in enumerate(data["requests"]):
        try:
            requests.append(
                TraceRequest(
                    id=str(r["id"]),
                    arrival_step=int(r.get("arrival_step", 0)),
                    prompt_token_ids=[int(t) for t in r["prompt_token_ids"]],
                    max_tokens=int(r["max_tokens"]),
                    priority=int(r.get("priority", 0)),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"trace request #{i} is malformed: {exc!r}") from exc
        if requests[-1].arrival_step < 0:
            raise ConfigError(f"trace request {requests[-1].id!r}: arrival_step must be >= 0")
    return Trace(sched, cache, requests)


class ReplayRunner:
    """A runner with no model: a request samples REPLAY_TOKEN_ID when its computed tokens reach
    its full length (the same rule the real runner follows)."""

    def __init__(self, scheduler: Scheduler, token_id: int = REPLAY_TOKEN_ID) -> None:
        self.scheduler = scheduler
        self.token_id = token_id

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            sampled.append([self.token_id] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )


@dataclass
class StepRecord:
    step: int
    scheduler_output: SchedulerOutput
    finished: list[str]
    num_free_blocks: int


def run_steps(trace: Trace, max_steps: int = 1_000_000) -> Iterator[StepRecord | RequestRejected]:
    """Drive the scheduler over the trace, yielding each step (and each rejection as it happens)."""
    scheduler = make_scheduler(trace.scheduler_config, trace.cache_config, clock=lambda: 0.0)
    runner = ReplayRunner(scheduler)
    by_step: dict[int, list[TraceRequest]] = {}
    for r in trace.requests:
        by_step.setdefault(r.arrival_step, []).append(r)
    last_arrival = max(by_step, default=-1)
    arrival_seq = 0
    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise RuntimeError(f"replay did not finish within {max_steps} steps")
        for tr in by_step.get(step, ()):
            # Arrival order is the FCFS order and the priority tie-break, as time.time() is in vLLM.
            arrival_seq += 1
            params = SamplingParams(max_tokens=tr.max_tokens, temperature=0.0)
            try:
                scheduler.add_request(Request(tr.id, tr.prompt_token_ids, params, float(arrival_seq), tr.priority))
            except RequestRejected as exc:
                exc.request_id = tr.id  # type: ignore[attr-defined]
                yield exc
        output = scheduler.schedule()
        runner_output = runner.execute_model(output)
        engine_outputs = scheduler.update_from_output(output, runner_output)
        finished = [o.request_id for o in engine_outputs if o.finished]
        yield StepRecord(step, output, finished, scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
        step += 1


def replay(trace_data: dict[str, Any]) -> dict[str, Any]:
    """Replay a trace (the dict form of TRACE.json) and return the STEPS.json dict."""
    trace = parse_trace(trace_data)
    steps: list[dict[str, Any]] = []
    rejected: list[str] = []
    reasons: dict[str, str] = {}
    num_preempted = 0
    for item in run_steps(trace):
        if isinstance(item, RequestRejected):
            rejected.append(item.request_id)  # type: ignore[attr-defined]
            reasons[item.request_id] = str(item)  # type: ignore[attr-defined]
            continue
        out = item.scheduler_output
        num_preempted += len(out.preempted_req_ids)
        steps.append(
            {
                "step": item.step,
                "scheduled": dict(out.num_scheduled_tokens),
                "preempted": sorted(out.preempted_req_ids),
                "finished": item.finished,
                "num_free_blocks": item.num_free_blocks,
                "cached_tokens": dict(out.cached_tokens),
            }
        )
        if out.policy_actions:  # an opt-in policy acted (never with vLLM's defaults)
            steps[-1]["policy"] = out.policy_actions
    total_tokens = sum(sum(s["scheduled"].values()) for s in steps)
    return {
        "steps": steps,
        "summary": {
            "rejected": rejected,
            "rejection_reasons": reasons,
            "num_steps": len(steps),
            "total_scheduled_tokens": total_tokens,
            "num_preemptions": num_preempted,
        },
    }


def replay_file(trace_path: str | Path, out_path: str | Path | None = None) -> dict[str, Any]:
    data = json.loads(Path(trace_path).read_text())
    result = replay(data)
    if out_path is not None:
        Path(out_path).write_text(json.dumps(result, indent=1))
    return result
