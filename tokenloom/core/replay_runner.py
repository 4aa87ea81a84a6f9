"""The replay's model-less runner and the helpers both drivers share: a request samples a fixed token
when its prompt is computed, drafts are accepted by script. Driven by core/replay.py (sync) and
core/replay_async.py (async scheduling)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.replay_trace import ScriptCycle, TraceRequest
from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.sampling_params import SamplingParams

REPLAY_TOKEN_ID = 7
DRAFT_TOKEN_ID = 9

class ReplayRunner:
    """A runner with no model: a request samples REPLAY_TOKEN_ID when its computed tokens reach
    its full length (the same rule the real runner follows). With drafts scheduled, a running
    request accepts the next value of its `accept` script (9s, then the bonus 7); a request admitted
    in this batch carries first-decode padding, always rejected. `spec` records [drafts, accepted].
    Under async scheduling it runs right after each schedule() (replay_async.py); its drafts are the
    AsyncScheduler's K placeholders, which the scripted runner "fills" with 9s the same way."""

    def __init__(self, scheduler: Scheduler, token_id: int = REPLAY_TOKEN_ID,
                 accept: dict[str, ScriptCycle] | None = None) -> None:
        self.scheduler = scheduler
        self.token_id = token_id
        self.accept = accept or {}
        self.spec: dict[str, list[int]] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        admitted = {new.req_id for new in scheduler_output.scheduled_new_reqs}
        self.spec = {}
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            # A partial prefill samples nothing: vLLM's is_prefill_chunk, set by this schedule()
            # (computed < num_tokens + the placeholders before it; placeholders are 0 in sync mode).
            if request.is_prefill_chunk:
                sampled.append([])
                continue
            d = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            a = 0
            if d and rid not in admitted:
                script = self.accept.setdefault(rid, ScriptCycle([], 0))
                a = min(script.next(), d)
            if d:
                self.spec[rid] = [d, a]
            sampled.append([DRAFT_TOKEN_ID] * a + [self.token_id])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )


def pending_drafts(scheduler: Scheduler) -> dict[str, int]:
    """{id: len(spec_token_ids)} for every request with pending drafts (async: K placeholders)."""
    return {r.request_id: len(r.spec_token_ids) for r in scheduler.requests.values() if r.spec_token_ids}


def admit_arrivals(scheduler: Scheduler, arrivals: Iterable[TraceRequest],
                   arrival_seq: Iterator[int]) -> Iterator[RequestRejected]:
    """Add a step's arriving requests to the scheduler, yielding each rejection (named by its id).
    Arrival order is the FCFS order and the priority tie-break, as time.time() is in vLLM."""
    for tr in arrivals:
        params = SamplingParams(max_tokens=tr.max_tokens, temperature=0.0)
        try:
            scheduler.add_request(Request(tr.id, tr.prompt_token_ids, params, float(next(arrival_seq)), tr.priority))
        except RequestRejected as exc:
            exc.request_id = tr.id  # type: ignore[attr-defined]
            yield exc


def unfinished_ids(scheduler: Scheduler) -> list[str]:
    """Running then waiting requests, in the scheduler's order."""
    return [r.request_id for r in scheduler.running] + [r.request_id for r in scheduler.waiting]
