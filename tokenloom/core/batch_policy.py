"""Static and request-level batching: the baselines continuous batching is compared against (the
Orca paper's request-level scheduling). vLLM has only continuous batching; these are opt-in
(`batching="static" | "request"`).

Both form a batch from the head of the waiting queue (up to max_num_seqs, in policy order) and
admit nobody else until every member has finished. Static batching also runs the batch in lockstep:
every member's prompt first, then the decodes. Everything else (budget, chunking, preemption) is the
continuous scheduler's: this is a policy (core/policies.py StepPolicy) with two step hooks,
`refuse_admission` and `hold_decodes`, and the `freed` hook that ends a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.core.policies import StepContext, StepPolicy
from tokenloom.core.request import Request


@dataclass
class BatchFormation(StepPolicy):
    lockstep: bool  # static batching: the batch's prompts first, then its decodes
    # The members of the batch in flight, by id.
    members: dict[str, Request] = field(default_factory=dict)

    def refuse_admission(self, ctx: StepContext, request: Request) -> str | None:
        if not self.members:
            if ctx.running:
                return "batch"
            # Form the next batch from the head of the waiting queue, in policy order.
            self.members = {r.request_id: r for r, _ in zip(ctx.waiting, range(ctx.max_num_running_reqs))}
        return None if request.request_id in self.members else "batch"

    def hold_decodes(self, ctx: StepContext) -> bool:
        """Static batching runs the batch in lockstep: every prompt first, then the decodes."""
        return self.lockstep and any(r.num_output_tokens == 0 for r in self.members.values())

    def freed(self, request_id: str) -> None:
        self.members.pop(request_id, None)
