"""Scheduling policies beyond vLLM 0.32's core loop: one protocol, `StepPolicy`, whose hooks the
scheduler calls at fixed points of a request's life and of every step.

The scheduler (core/scheduler.py) holds the policies a configuration runs in `step_policies` and asks
them, in this order, each hook on every policy that overrides it:

    a request's life   arrived (add_request) · admitted (waiting -> running) · freed (finished, aborted)
    each schedule()    preempt -> budget -> reserve, before the running pass; refuse_admission for each
                       waiting request it would admit, and hold_decodes once; scheduled, once the output is
                       built (before the computed frontier advances)
    after execution    step_done (the engine core's measured step time: Scheduler.observe_step_time)

A hook sees the step through a `StepContext` (the queues, the KV cache manager, the budget's facts) and
acts only through it: preemption goes through `StepContext.preempt` (the scheduler's own recompute
preemption), and why a policy acted goes into `StepContext.actions` (the step's
`SchedulerOutput.policy_actions`, which the step trace writes out). A hook a policy does not override
costs nothing: the scheduler calls only the overriding ones.

The policies, and what turns each on:
- `PrefillWaitBound` (here; --max-prefill-wait-ms or --max-prefill-wait-steps, --min-prefill-chunk):
  `reserve`: a prompt that has waited longer than the bound without its first token gets a guaranteed
  share of the step's token budget, so a steady stream of decodes can no longer starve it (vLLM issues
  #14003, #57413). The share comes out of the running requests' part of the budget: the decodes that no
  longer fit wait one step, which is the inter-token latency this policy trades for a bounded time to
  first token.
- `PriorityPreemption` (here; --enable-priority-preemption, with --scheduling-policy priority): `preempt`:
  when the highest-priority waiting request cannot be admitted (no sequence slot or no KV blocks),
  running requests of strictly lower priority are preempted for it (vLLM #40004: vLLM only preempts when
  a running request cannot grow). A request preempted this way is protected from being preempted again
  by this policy for `protection_steps` steps after it resumes, so nobody thrashes.
- `SloBudgetController` (core/slo_budget.py; --target-itl-ms, --target-ttft-ms): `budget` from the step
  cost model (core/cost_model.py), corrected by `step_done`.
- `AutoTokenBudget` (core/auto_budget.py; on by default when max_num_batched_tokens is not given):
  `budget` bounded by this machine's measured prefill rate, learnt in `step_done`.
- `BatchFormation` (core/batch_policy.py; --batching static | request): the comparison baselines,
  through `refuse_admission` and `hold_decodes`.

With their knobs at vLLM's values none of them runs (an explicit max_num_batched_tokens, continuous
batching: `step_policies` is empty), so the default schedule stays vLLM's decision for decision.

Pure Python, like the rest of tokenloom/core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.core.request import Request

if TYPE_CHECKING:
    from tokenloom.core.kv_cache_manager import KVCacheManager
    from tokenloom.core.outputs import SchedulerOutput
    from tokenloom.core.request_queue import FCFSRequestQueue, PriorityRequestQueue


@dataclass(slots=True)
class StepContext:
    """What a policy sees of the step being scheduled, and the one thing it may do to it (preempt).

    The lists are the scheduler's own (not copies): `running` shrinks as requests are preempted,
    `preempted` and `actions` are the step's output in the making."""

    now: float  # the scheduler's clock at the start of the step
    step: int  # schedule() calls before this one
    running: list[Request]
    waiting: FCFSRequestQueue | PriorityRequestQueue
    requests: dict[str, Request]  # every unfinished request, by id
    kv_cache_manager: KVCacheManager
    max_num_running_reqs: int
    threshold: int  # this step's long-prefill cap per request (0: none)
    preempted: list[Request]  # preempted in this step so far
    actions: dict[str, Any]  # policy name -> why it acted (SchedulerOutput.policy_actions)
    _preempt: Callable[[Request, float], None]  # the scheduler's recompute preemption of a running request

    def free_slots(self) -> int:
        """Sequence slots a waiting request could take this step (none once this step preempted: a step
        never frees blocks and fills them at once)."""
        return 0 if self.preempted else self.max_num_running_reqs - len(self.running)

    def admissible_waiting(self) -> Iterable[Request]:
        """The waiting queue when a request could be admitted this step (a slot free), else nothing."""
        return self.waiting if self.free_slots() > 0 else ()

    def preempt(self, request: Request) -> None:
        """Preempt a running request (recompute: its blocks and progress go; it waits again)."""
        self.running.remove(request)
        self._preempt(request, self.now)
        self.preempted.append(request)


class StepPolicy:
    """The hooks of a scheduling policy; each does nothing unless the policy overrides it."""

    # A request's life ---------------------------------------------------------------------------
    def arrived(self, request_id: str, step: int) -> None:
        """Queued by add_request at scheduler step `step`."""

    def admitted(self, request_id: str, step: int) -> None:
        """Moved from waiting to running (first admission or a resume) at step `step`."""

    def freed(self, request_id: str) -> None:
        """Finished or aborted: drop what the policy keeps about it."""

    # The step, in the order schedule() asks -------------------------------------------------------
    def preempt(self, ctx: StepContext) -> str | None:
        """Before the passes: preempt running requests through ctx.preempt; the step's bound_by if it did."""
        return None

    def budget(self, ctx: StepContext, budget: int) -> int:
        """This step's token budget, given the one so far (max_num_batched_tokens, or an earlier policy's)."""
        return budget

    def reserve(self, ctx: StepContext, budget: int) -> tuple[int, list[str]]:
        """Tokens of `budget` held back from the running requests for the listed ones (0, []: none)."""
        return 0, []

    def hold_decodes(self, ctx: StepContext) -> bool:
        """Whether this step schedules prefills only."""
        return False

    def refuse_admission(self, ctx: StepContext, request: Request) -> str | None:
        """None to let the head of the waiting queue in (budget and slots aside), or why not: the step's
        bound_by; admission stops for this step."""
        return None

    def scheduled(self, ctx: StepContext, output: SchedulerOutput) -> None:
        """The step's output is built (progress not advanced yet)."""

    # After execution ------------------------------------------------------------------------------
    def step_done(self, output: SchedulerOutput, seconds: float) -> None:
        """The step ran in `seconds` (wall time in the engine, virtual in the simulator)."""


# Every hook, in the order StepPolicy declares them.
HOOKS = tuple(name for name, value in vars(StepPolicy).items() if callable(value) and not name.startswith("_"))


def overriding(policies: Iterable[StepPolicy], hook: str) -> list[StepPolicy]:
    """The policies that override `hook` (the scheduler calls only those)."""
    default = getattr(StepPolicy, hook)
    return [p for p in policies if getattr(type(p), hook) is not default]


@dataclass
class PrefillWaitBound(StepPolicy):
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

    def freed(self, request_id: str) -> None:
        self.arrival_step.pop(request_id, None)

    def starved(self, now: float, step: int, request: Request) -> bool:
        """Waited past a bound and still has prompt (or recompute) work before its first token."""
        if request.first_token_time is not None or request.num_tokens - request.num_computed_tokens <= 0:
            return False
        if self.max_wait_s > 0 and now - request.arrival_time > self.max_wait_s:
            return True
        waited_steps = step - self.arrival_step.get(request.request_id, step)
        return self.max_wait_steps > 0 and waited_steps > self.max_wait_steps

    def reserve(self, ctx: StepContext, budget: int) -> tuple[int, list[str]]:
        """Tokens to hold back from the other running requests this step, and the starved requests.

        A waiting prompt counts only when it is next in line and a sequence slot is free (it could
        be admitted this step); otherwise reserving budget for it would only idle the budget.
        """
        ids = [r.request_id for r in ctx.running if self.starved(ctx.now, ctx.step, r)]
        head = ctx.waiting.peek_request() if ctx.waiting else None
        if head is not None and ctx.free_slots() > 0 and self.starved(ctx.now, ctx.step, head):
            ids.append(head.request_id)
        if not ids:
            return 0, []
        reserve = min(self.min_chunk, budget)
        ctx.actions["prefill_reserve"] = {"tokens": reserve, "requests": ids}
        return reserve, ids


@dataclass
class PriorityPreemption(StepPolicy):
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

    def preempt(self, ctx: StepContext) -> str | None:
        """Free a slot / blocks for the highest-priority waiting request by preempting strictly
        lower-priority running ones. It is admitted in the next step: a step that preempted admits
        nobody (the same rule as preemption for a running request)."""
        if not ctx.waiting or not ctx.running:
            return None
        head = ctx.waiting.peek_request()
        kv = ctx.kv_cache_manager
        victims = self.victims_for(head, ctx.running, ctx.step)
        need = kv.blocks_needed(head.num_tokens) + kv.watermark_blocks  # (others run: the watermark applies)

        def slots_full() -> bool:
            return len(ctx.running) >= ctx.max_num_running_reqs

        def short_of_blocks() -> bool:
            return kv.block_pool.get_num_free_blocks() < need

        if not victims or not (slots_full() or short_of_blocks()):
            return None
        if not slots_full():
            # Blocked by KV alone: preempt only if the victims' blocks can make it fit.
            reclaimable = sum(kv.num_blocks_held(v.request_id) for v in victims)
            if kv.block_pool.get_num_free_blocks() + reclaimable < need:
                return None
        preempted: list[str] = []
        while victims and (slots_full() or short_of_blocks()):
            victim = victims.pop()
            ctx.preempt(victim)
            self._to_protect.add(victim.request_id)
            preempted.append(victim.request_id)
        ctx.actions["priority_preemption"] = {"for": head.request_id, "preempted": preempted}
        return "priority_preemption"

    def admitted(self, request_id: str, step: int) -> None:
        if request_id in self._to_protect:
            self._to_protect.discard(request_id)
            self.protected_until[request_id] = step + self.protection_steps

    def freed(self, request_id: str) -> None:
        self._to_protect.discard(request_id)
        self.protected_until.pop(request_id, None)
