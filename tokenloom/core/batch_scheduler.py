"""Static and request-level batching: the baselines continuous batching is compared against (the
Orca paper's request-level scheduling). vLLM has only continuous batching; these are opt-in
(`batching="static" | "request"`).

Both form a batch from the head of the waiting queue (up to max_num_seqs, in policy order) and
admit nobody else until every member has finished. Static batching also runs the batch in lockstep:
every member's prompt first, then the decodes. Everything else (budget, chunking, preemption) is the
continuous scheduler's, through its two hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler


class BatchScheduler(Scheduler):
    batching_modes = ("static", "request")

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        clock: Callable[[], float] = time.monotonic,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        super().__init__(scheduler_config, cache_config, clock, speculative_config)
        # The members of the batch in flight.
        self._batch_ids: set[str] = set()

    def _admission_open(self, request: Request) -> bool:
        if not self._batch_ids:
            if self.running:
                return False
            # Form the next batch from the head of the waiting queue, in policy order.
            members = [r.request_id for r, _ in zip(self.waiting, range(self.max_num_running_reqs))]
            self._batch_ids = set(members)
        return request.request_id in self._batch_ids

    def _hold_decodes(self) -> bool:
        """Static batching runs the batch in lockstep: every prompt first, then the decodes."""
        if self.scheduler_config.batching != "static" or not self._batch_ids:
            return False
        return any(self.requests[rid].num_output_tokens == 0 for rid in self._batch_ids)

    def _free_request(self, request: Request) -> None:
        super()._free_request(request)
        self._batch_ids.discard(request.request_id)
