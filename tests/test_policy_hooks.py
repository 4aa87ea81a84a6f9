"""The scheduling policies' one protocol (core/policies.py StepPolicy): which policies a configuration runs,
that the scheduler asks their hooks at the documented points and in the documented order, that a policy of
one's own plugs in through `Scheduler.add_policy`, and that the scheduler keeps no policy's logic itself.

The decisions each built-in policy makes are tested where the policy is (test_scheduling_policies.py,
test_slo_budget.py, test_auto_budget.py, the batching-mode tests in test_scheduler.py); vLLM's defaults
run no policy at all, which the replay conformance and tests/peer hold to vLLM's decisions."""

from __future__ import annotations

import ast
import inspect

import pytest

from tests.sched_utils import create_requests, create_scheduler, runner_output, step
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core import scheduler as scheduler_module
from tokenloom.core.auto_budget import AutoTokenBudget
from tokenloom.core.batch_policy import BatchFormation
from tokenloom.core.policies import HOOKS, PrefillWaitBound, PriorityPreemption, StepContext, StepPolicy
from tokenloom.core.request import Request
from tokenloom.core.scheduler_factory import make_scheduler


def _kinds(sched) -> list[type]:
    return [type(p) for p in sched.step_policies]


def test_vllm_s_defaults_run_no_policy_and_each_knob_adds_its_own() -> None:
    assert create_scheduler().step_policies == []  # an explicit budget: vLLM's scheduler, nothing else
    assert all(hooks == [] for hooks in create_scheduler()._hooks.values())
    cache = CacheConfig(block_size=16, num_blocks=64)
    assert _kinds(make_scheduler(SchedulerConfig(), cache)) == [AutoTokenBudget]  # no budget given: the default
    sched = create_scheduler(policy="priority", enable_priority_preemption=True, max_prefill_wait_steps=3,
                             min_prefill_chunk=4, batching="static")
    # The order each hook is asked in: preemption before budgets before reserves.
    assert _kinds(sched) == [PriorityPreemption, PrefillWaitBound, BatchFormation]
    assert sched._hooks["preempt"] == [sched.priority_preemption]
    assert sched._hooks["reserve"] == [sched.prefill_wait_bound]
    assert sched._hooks["refuse_admission"] == sched._hooks["hold_decodes"] == [sched.batch_formation]
    assert sched._hooks["freed"] == [sched.priority_preemption, sched.prefill_wait_bound, sched.batch_formation]
    assert sched._hooks["budget"] == [] and sched._hooks["step_done"] == []


class _Recorder(StepPolicy):
    """Overrides every hook: records what the scheduler asked, and changes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def arrived(self, request_id: str, step: int) -> None:
        self.calls.append(("arrived", request_id))

    def admitted(self, request_id: str, step: int) -> None:
        self.calls.append(("admitted", request_id))

    def freed(self, request_id: str) -> None:
        self.calls.append(("freed", request_id))

    def preempt(self, ctx: StepContext) -> str | None:
        self.calls.append(("preempt",))
        return None

    def budget(self, ctx: StepContext, budget: int) -> int:
        self.calls.append(("budget", str(budget)))
        return budget

    def reserve(self, ctx: StepContext, budget: int) -> tuple[int, list[str]]:
        self.calls.append(("reserve",))
        return 0, []

    def hold_decodes(self, ctx: StepContext) -> bool:
        self.calls.append(("hold_decodes",))
        return False

    def refuse_admission(self, ctx: StepContext, request: Request) -> str | None:
        self.calls.append(("refuse_admission", request.request_id))
        return None

    def scheduled(self, ctx: StepContext, output) -> None:
        self.calls.append(("scheduled", *sorted(output.num_scheduled_tokens)))

    def step_done(self, output, seconds: float) -> None:
        self.calls.append(("step_done",))


def test_hooks_are_asked_at_their_points_in_order() -> None:
    sched = create_scheduler(max_num_batched_tokens=64)
    recorder = _Recorder()
    sched.add_policy(recorder)
    (request,) = create_requests(1, num_tokens=8, max_tokens=1, ignore_eos=True)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))
    sched.observe_step_time(out, 0.01)
    before_step = [("preempt",), ("budget", "64"), ("reserve",), ("hold_decodes",)]
    assert recorder.calls == [("arrived", "0"), *before_step, ("refuse_admission", "0"), ("admitted", "0"),
                              ("scheduled", "0"), ("freed", "0"), ("step_done",)]
    # An abort frees through the same hook.
    recorder.calls.clear()
    sched.add_request(create_requests(1, prefix="x")[0])
    sched.finish_requests("x0", request.status.FINISHED_ABORTED)
    assert recorder.calls == [("arrived", "x0"), ("freed", "x0")]


class _OnePromptAtATime(StepPolicy):
    """A policy of one's own: admit a request only while no other is still prefilling, and cap the
    budget at 10 tokens; says why in the step's policy actions."""

    def budget(self, ctx: StepContext, budget: int) -> int:
        ctx.actions["cap"] = 10
        return min(budget, 10)

    def refuse_admission(self, ctx: StepContext, request: Request) -> str | None:
        return "one_prompt" if any(r.is_prefill for r in ctx.running) else None


def test_a_policy_of_one_s_own_changes_the_decisions() -> None:
    sched = create_scheduler(max_num_batched_tokens=64)
    sched.add_policy(_OnePromptAtATime())
    for r in create_requests(2, num_tokens=15, max_tokens=2, ignore_eos=True):
        sched.add_request(r)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"0": 10} and out.policy_actions == {"cap": 10}
    out, _ = step(sched)  # "0" finishes its prompt (5 tokens); "1" waits while "0" is still a prefill
    assert out.num_scheduled_tokens == {"0": 5} and out.bound_by == "one_prompt"
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"0": 1, "1": 9}


def test_add_policy_refuses_what_it_cannot_honour() -> None:
    sched = create_scheduler()
    with pytest.raises(TypeError, match="StepPolicy"):
        sched.add_policy(object())  # type: ignore[arg-type]
    sched.add_request(create_requests(1)[0])
    with pytest.raises(ValueError, match="before the first"):
        sched.add_policy(_Recorder())


def test_the_scheduler_keeps_no_policy_s_logic() -> None:
    """The policies are reached through the hooks only: outside __init__ (which builds them) the scheduler's
    source names none of them, and it names every hook it documents."""
    source = inspect.getsource(scheduler_module)
    tree = ast.parse(source)
    attrs = {"prefill_wait_bound", "priority_preemption", "slo_budget", "auto_budget", "batch_formation"}
    offenders = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr in attrs:
                    offenders.append(f"{fn.name}: .{node.attr}")
    assert offenders == []
    asked = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in HOOKS}
    assert asked == set(HOOKS)  # every hook is asked somewhere (self._hooks["..."])
