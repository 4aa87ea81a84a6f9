"""SimulatedRunner: the runner interface with no weights. Same scheduler, modelled step times.

It follows the real runner's sampling rule: a scheduled request samples iff its computed tokens reach
its current length (start + n == length), where start comes from the SchedulerOutput and the runner
keeps each length itself (prefill_token_ids when the request arrives, +1 per sample). Every sample is
the same non-EOS token; requests stop by max_tokens (the simulator sets max_tokens to the target output
length and ignore_eos), so the scheduler needs no change.

Each step lasts what the cost model says for its shape; the runner advances the virtual clock that the
scheduler reads, so every timestamp (first_token_time, finished_time, the step trace) is simulated time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenloom.core.cost_model import CostModel, StepShape
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.workload.clock import VirtualClock

# Not special in any vocabulary we run (SmolLM2's specials are 0..16); never an EOS.
SIM_TOKEN_ID = 7


class SequenceTracker:
    """A runner's view of its requests: each one's current length, and which rows sample.

    The same bookkeeping as the real runner's (prefill_token_ids when a request arrives, +1 per
    sample, dropped when finished or preempted), so the step's shape can be read from any run.
    """

    def __init__(self) -> None:
        self.lengths: dict[str, int] = {}
        # Tokens each request has really computed (the real runner's num_computed): under async
        # scheduling with drafts the scheduler counts the drafts in flight as computed, the
        # rejected ones are not, so a step starts from here (the real runner's _realign).
        self.computed: dict[str, int] = {}
        # Real drafts each request verifies in the last step (its placeholder slots filled).
        self.num_drafts: dict[str, int] = {}
        # Pooling requests (embeddings, scores): prefill only; the step that ends a prompt pools it
        # (no LM-head row in the step's shape) and the request finishes there.
        self.pooling: set[str] = set()

    def forget(self, rid: str) -> None:
        self.lengths.pop(rid, None)
        self.computed.pop(rid, None)
        self.pooling.discard(rid)

    def clear(self) -> None:
        self.lengths.clear()
        self.computed.clear()
        self.pooling.clear()

    def step(self, scheduler_output: SchedulerOutput,
             fill: Callable[[str, int, int], int] | None = None) -> tuple[StepShape, list[bool]]:
        """The step's shape and, in num_scheduled_tokens order, whether each request samples.

        A sampling request's length grows by one here; `accept` adds its accepted drafts.
        `fill(req_id, length, num_slots)`: how many of a request's placeholder drafts (-1, async
        scheduling) the runner has real drafts for; the rest are trimmed, as the real runner does."""
        lengths = self.lengths
        # Finished and preempted requests lose their state; a preempted one comes back as new.
        for rid in scheduler_output.finished_req_ids:
            self.forget(rid)
        for rid in scheduler_output.preempted_req_ids:
            self.forget(rid)
        self.num_drafts = {}
        starts: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            lengths[new.req_id] = len(new.prefill_token_ids)
            starts[new.req_id] = new.num_computed_tokens
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        shape = StepShape()
        samples: list[bool] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            start = min(starts[rid], self.computed.get(rid, starts[rid]))
            length = lengths[rid]
            drafts = spec.get(rid, ())
            num_drafts = len(drafts)
            if drafts and drafts[0] < 0 and fill is not None:
                filled = fill(rid, length, num_drafts)
                n -= num_drafts - filled
                num_drafts = filled
                self.num_drafts[rid] = filled
            sample = start + n == length + num_drafts
            shape.add_row(start, n, sample and rid not in self.pooling, num_drafts)
            self.computed[rid] = start + n - num_drafts
            if sample:
                lengths[rid] = length + 1
            samples.append(sample)
        return shape, samples


@dataclass
class SimulatedDrafts:
    """The simulated proposer's output (the shape of the real runner's DraftTokenIds)."""

    req_ids: list[str]
    draft_token_ids: list[list[int]]


class SimulatedRunner:
    """With speculative decoding (`num_spec_tokens` K > 0): after each step every request that
    sampled is offered K drafts (capped at max_model_len - its length, as the n-gram proposer), and
    each verified draft is accepted with probability `spec_acceptance`, in order until the first
    rejection (placeholder drafts, -1, are always rejected)."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = SIM_TOKEN_ID, *,
                 num_spec_tokens: int = 0, spec_acceptance: float = 0.0, max_model_len: int | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        if not 0.0 <= spec_acceptance <= 1.0:
            raise ValueError(f"spec_acceptance must be in [0, 1], got {spec_acceptance}")
        self.cost_model = cost_model
        self.clock = clock
        self.token_id = token_id
        self.tracker = SequenceTracker()
        self.num_spec_tokens = num_spec_tokens
        self.spec_acceptance = spec_acceptance
        self.max_model_len = max_model_len
        self.rng = np.random.default_rng(seed)
        self._drafts: SimulatedDrafts | None = None
        self._proposed: set[str] = set()  # requests that have sampled: they have a proposal

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for rid in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self._proposed.discard(rid)  # its proposer state goes with it (a preempted one comes back new)
        shape, samples = self.tracker.step(scheduler_output, self._fill if self.num_spec_tokens else None)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        # An empty step runs no model (the real runner returns at once): it costs no time.
        seconds = self.cost_model.predict(shape) if req_ids else 0.0
        self.clock.advance(seconds)
        pooling = self.tracker.pooling
        sampled = [[self.token_id] if sample and rid not in pooling else [] for rid, sample in zip(req_ids, samples)]
        # A pooling request whose prompt ends here is pooled: an empty vector stands for its output.
        pooled = {rid: np.zeros(0, dtype=np.float32) for rid, sample in zip(req_ids, samples)
                  if sample and rid in pooling}
        if self.num_spec_tokens:
            self._verify_and_propose(scheduler_output, req_ids, sampled)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            execute_time=seconds,
            pooler_output=pooled or None,
        )

    def _verify_and_propose(self, so: SchedulerOutput, req_ids: list[str], sampled: list[list[int]]) -> None:
        lengths = self.tracker.lengths
        proposed: list[str] = []
        filled = self.tracker.num_drafts
        for rid, out in zip(req_ids, sampled):
            if not out:
                continue
            # Async scheduling: the placeholder slots the runner filled with its own drafts.
            drafts = [self.token_id] * filled[rid] if rid in filled else so.scheduled_spec_decode_tokens.get(rid, ())
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] >= 0 and self.rng.random() < self.spec_acceptance:
                accepted += 1
            out[:0] = [self.token_id] * accepted
            lengths[rid] += accepted
            self.tracker.computed[rid] += accepted
            proposed.append(rid)
            self._proposed.add(rid)
        k, cap = self.num_spec_tokens, self.max_model_len
        lists = [[self.token_id] * max(0, min(k, cap - lengths[r]) if cap else k) for r in proposed]
        self._drafts = SimulatedDrafts(proposed, lists) if proposed else None

    def _fill(self, rid: str, length: int, num_slots: int) -> int:
        """Async scheduling: the drafts for a request's placeholder slots, from its proposal after its
        last step (none before it has sampled once), capped at max_model_len as the proposer is."""
        if rid not in self._proposed:
            return 0
        cap = self.max_model_len
        return max(0, min(num_slots, self.num_spec_tokens, cap - length if cap else num_slots))

    def take_draft_token_ids(self) -> SimulatedDrafts | None:
        drafts, self._drafts = self._drafts, None
        return drafts
