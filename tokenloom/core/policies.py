"""Opt-in scheduling policies that vLLM 0.32 does not have, as small objects the scheduler consults.

With their knobs at the defaults none of them exists (the scheduler holds `None`), so the default
schedule stays vLLM's decision for decision. Each one says why it acted in the step's
`SchedulerOutput.policy_actions`, which the step trace writes out.

- `PrefillWaitBound` (--max-prefill-wait-ms or --max-prefill-wait-steps, --min-prefill-chunk): a
  prompt that has waited longer than the bound without its first token gets a guaranteed share of
  the step's token budget, so a steady stream of decodes can no longer starve it (vLLM issues
  #14003, #57413). The share comes out of the running requests' part of the budget: the decodes
  that no longer fit wait one step, which is the inter-token latency this policy trades for a
  bounded time to first token.
- `PriorityPreemption` (--enable-priority-preemption, with --scheduling-policy priority): when the
  highest-priority waiting request cannot be admitted (no sequence slot or no KV blocks), running
  requests of strictly lower priority are preempted for it (vLLM #40004: vLLM only preempts when a
  running request cannot grow). A request preempted this way is protected from being preempted again
  by this policy for `protection_steps` steps after it resumes, so nobody thrashes.

The third, the SLO-driven token budget (--target-itl-ms, --target-ttft-ms), is its own manager in
core/slo_budget.py: it predicts steps with the cost model (core/cost_model.py).

Pure Python, like the rest of tokenloom/core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenloom.core.request import Request


class RequestLifecycle:
    """What a policy beyond vLLM's hears of a request's life: its arrival, its admission into the
    running batch, and its end. The scheduler calls every hook on every policy it runs (its
    `lifecycle_policies`), in one place each; a hook does nothing unless the policy overrides it."""

    def arrived(self, request_id: str, step: int) -> None:
        """Queued by add_request at scheduler step `step`."""

    def admitted(self, request_id: str, step: int) -> None:
        """Moved from waiting to running (first admission or a resume) at step `step`."""

    def forget(self, request_id: str) -> None:
        """Finished or aborted: drop what the policy keeps about it."""


@dataclass
class PrefillWaitBound(RequestLifecycle):
    """Reserve `min_chunk` tokens of the budget for prompts that have waited past a bound.

    The bound is in seconds (`max_wait_s`, from --max-prefill-wait-ms: what an SLO is written in)
    and/or in scheduler steps (`max_wait_steps`: deterministic, for replays and property tests);
    0 disables that form. A request is starved when either bound is passed.
    """

    max_wait_s: float
    max_wait_steps: int
    min_chunk: int
    # request id → the scheduler step at which it arrived (for the step bound).
    arrival_step: dict[str, int] = field(default_factory=dict)

    def arrived(self, request_id: str, step: int) -> None:
        self.arrival_step[request_id] = step

    def forget(self, request_id: str) -> None:
        self.arrival_step.pop(request_id, None)

    def starved(self, now: float, step: int, request: Request) -> bool:
        """Waited past a bound and still has prompt (or recompute) work before its first token."""
        if request.first_token_time is not None or request.num_tokens - request.num_computed_tokens <= 0:
            return False
        if self.max_wait_s > 0 and now - request.arrival_time > self.max_wait_s:
            return True
        waited_steps = step - self.arrival_step.get(request.request_id, step)
        return self.max_wait_steps > 0 and waited_steps > self.max_wait_steps

    def reserve(
        self, now: float, step: int, running: list[Request], waiting_head: Request | None, can_admit: bool,
        budget: int,
    ) -> tuple[int, list[str]]:
        """Tokens to hold back from the other running requests this step, and the starved requests.

        A waiting prompt counts only when it is next in line and a sequence slot is free (it could
        be admitted this step); otherwise reserving budget for it would only idle the budget.
        """
        ids = [r.request_id for r in running if self.starved(now, step, r)]
        if waiting_head is not None and can_admit and self.starved(now, step, waiting_head):
            ids.append(waiting_head.request_id)
        if not ids:
            return 0, []
        return min(self.min_chunk, budget), ids


@dataclass
class PriorityPreemption(RequestLifecycle):
    """Preempt strictly lower-priority running requests for a blocked higher-priority waiting one."""

    protection_steps: int
    # request id → the first step at which it may again be preempted by this policy.
    protected_until: dict[str, int] = field(default_factory=dict)
    # Preempted by this policy and not yet resumed: protection starts when they run again.
    _to_protect: set[str] = field(default_factory=set)

    def victims_for(self, head: Request, running: Iterable[Request], step: int) -> list[Request]:
        """Running requests this policy may preempt for `head`, the first choice last."""
        candidates = [
            r for r in running
            if r.priority > head.priority and self.protected_until.get(r.request_id, -1) <= step
        ]
        # The same victim order as vLLM's priority preemption: the largest (priority, arrival).
        candidates.sort(key=lambda r: (r.priority, r.arrival_time))
        return candidates

    def preempted(self, request: Request) -> None:
        self._to_protect.add(request.request_id)

    def admitted(self, request_id: str, step: int) -> None:
        if request_id in self._to_protect:
            self._to_protect.discard(request_id)
            self.protected_until[request_id] = step + self.protection_steps

    def forget(self, request_id: str) -> None:
        self._to_protect.discard(request_id)
        self.protected_until.pop(request_id, None)
