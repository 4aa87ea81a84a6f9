"""AsyncScheduler: vLLM 0.32's scheduler for async scheduling (v1/core/sched/async_scheduler.py).

With async scheduling the engine schedules step N+1 while step N executes, so when N+1 is scheduled
the token N samples is not known yet. Instead of a fake token, each request that will sample in a
step carries an *output placeholder* (`num_output_placeholders`): its deficit
`num_tokens_with_spec + num_output_placeholders - num_computed_tokens` is then right (one decode
token, plus K drafts with speculative decoding) without knowing the token. The runner fills in the
real token from its own state when the step runs (it runs after step N in the same worker).

    _update_after_schedule        placeholders += 1 + len(scheduled drafts) for every scheduled
                                  request that will sample (not a prefill chunk); its next drafts
                                  become K placeholders [-1] * K (the worker proposes the real ones)
    _update_request_with_output   placeholders -= len(appended tokens) (not for stale output); the
                                  now-known tokens are committed to the prefix cache
    _grammar_lags                 a constrained request with a token in flight: its matcher has not
                                  seen it, so the step's grammar bitmask is deferred
                                  (pending_structured_output_tokens; the engine core fills it)

The rest lives in the base Scheduler, as in vLLM: the max_tokens guard (a request whose in-flight
step already yields its last token is skipped), the rollback of rejected drafts from placeholders,
stale output of a request preempted with a step in flight (appended, counters untouched), and late
output of a request that finished (or was aborted) meanwhile (dropped: `requests.get` is None).
"""

from __future__ import annotations

from tokenloom.core.outputs import SchedulerOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    def _grammar_lags(self, sampling: list[Request]) -> bool:
        # A placeholder is a token sampled (or being sampled) but not yet accepted by the matcher:
        # the bitmask must wait for it (vLLM: pending_structured_output_tokens).
        return any(r.num_output_placeholders > 0 for r in sampling)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        num_spec_tokens = getattr(self, "num_spec_tokens", 0)
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue
            # This step yields one sampled token plus its accepted drafts; count them all as in
            # flight (the rejected ones are taken back when the output arrives).
            request.num_output_placeholders += 1 + len(spec_decode_tokens.get(req_id, ()))
            # The worker proposes the next drafts; the scheduler only knows how many.
            request.spec_token_ids = [-1] * num_spec_tokens

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int], is_stale: bool = False
    ) -> tuple[list[int], bool]:
        status_before_update = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids, is_stale)
        # Placeholders were zeroed at preemption; a stale delivery must not decrement them.
        if not is_stale:
            request.num_output_placeholders -= len(new_token_ids)
            assert request.num_output_placeholders >= 0, f"placeholder underflow for {request.request_id!r}"
        # Commit the now-known tokens to the prefix cache (a preempted request holds no blocks).
        if status_before_update == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped
