"""The opt-in scheduling policies beyond vLLM (tokenloom/core/policies.py): each one's guarantee,
that it stays off by default, and the design's invariants with it on."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.sched_utils import (
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    decodes_then_long_prompt,
    step,
)
from tests.test_scheduler_properties import _block_accounting
from tokenloom.config import ConfigError, SchedulerConfig
from tokenloom.core.replay import replay
from tokenloom.core.replay_runner import ReplayRunner
from tokenloom.core.replay_trace import parse_trace
from tokenloom.core.request import Request
from tokenloom.core.scheduler import RequestRejected
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.sampling_params import SamplingParams


def _decodes_eat_the_budget(**knobs):
    """15 running decodes with a budget of 16 tokens (max_num_seqs 16): a 64-token prompt that
    arrives once they run gets the 1 token per step they leave, under vLLM's rules, for as long as
    they decode (a 64-step TTFT here; an 8k prompt behind 500 decodes at budget 512 is 680 steps)."""
    sched = create_scheduler(max_num_batched_tokens=16, max_num_seqs=16, max_model_len=512, **knobs)
    for r in create_requests(15, num_tokens=1, max_tokens=200, ignore_eos=True, prefix="d"):
        sched.add_request(r)
    step(sched)  # the 16 one-token prompts: each samples its first token
    prompt = create_requests(1, num_tokens=64, max_tokens=4, ignore_eos=True, prefix="long")[0]
    prompt.request_id = "long"
    sched.add_request(prompt)
    return sched


def _prompt_tokens_per_step(sched, steps: int) -> list[int]:
    got = []
    for _ in range(steps):
        out, _ = step(sched)
        got.append(out.num_scheduled_tokens.get("long", 0))
    return got


def test_without_the_bound_the_long_prompt_trickles() -> None:
    sched = _decodes_eat_the_budget()
    assert _prompt_tokens_per_step(sched, 30) == [1] * 30


def test_bound_in_steps_gives_the_starved_prompt_its_chunk() -> None:
    sched = _decodes_eat_the_budget(max_prefill_wait_steps=5, min_prefill_chunk=4)
    got = _prompt_tokens_per_step(sched, 30)
    # It trickles while its wait is within the bound (1 token a step for 6 steps: waited 0..5), then
    # gets 4 tokens a step until the 64 prompt tokens are in (TTFT 21 steps instead of 64).
    assert got[:6] == [1] * 6
    assert got[6:6 + 14] == [4] * 14 and got[20] == 64 - 6 - 14 * 4
    out, _ = step(sched)
    assert "prefill_reserve" not in out.policy_actions  # it has its first token: not starved any more


def test_bound_costs_the_decodes_exactly_the_reserve() -> None:
    sched = _decodes_eat_the_budget(max_prefill_wait_steps=1, min_prefill_chunk=4)
    for _ in range(2):
        step(sched)
    out, _ = step(sched)
    decodes = {r: n for r, n in out.num_scheduled_tokens.items() if r != "long"}
    assert out.num_scheduled_tokens["long"] == 4 and len(decodes) == 12  # 3 of the 15 decodes wait a step
    assert out.policy_actions["prefill_reserve"] == {"tokens": 4, "requests": ["long"]}


def test_bound_in_wall_time_uses_the_clock() -> None:
    now = [0.0]
    sched_cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=16, max_model_len=512,
                                max_prefill_wait_ms=250, min_prefill_chunk=8)
    from tokenloom.config import CacheConfig

    sched = make_scheduler(sched_cfg, CacheConfig(block_size=16, num_blocks=1000), clock=lambda: now[0])
    for r in create_requests(15, num_tokens=1, max_tokens=200, ignore_eos=True, prefix="d"):
        r.arrival_time = 0.0
        sched.add_request(r)
    step(sched)
    long = Request("long", [7] * 64, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    sched.add_request(long)
    now[0] = 0.2
    out, _ = step(sched)
    assert out.num_scheduled_tokens["long"] == 1
    now[0] = 0.3
    out, _ = step(sched)
    assert out.num_scheduled_tokens["long"] == 8


def test_policies_off_by_default_and_validated() -> None:
    cfg = SchedulerConfig()
    assert cfg.max_prefill_wait_ms == 0 and cfg.max_prefill_wait_steps == 0 and not cfg.enable_priority_preemption
    sched = create_scheduler()
    assert sched.prefill_wait_bound is None and sched.priority_preemption is None
    with pytest.raises(ConfigError, match="scheduling_policy='priority'"):
        SchedulerConfig(enable_priority_preemption=True)
    with pytest.raises(ConfigError, match="min_prefill_chunk"):
        SchedulerConfig(max_num_batched_tokens=256, max_prefill_wait_ms=100, min_prefill_chunk=256)
    with pytest.raises(ConfigError, match="max_prefill_wait_ms"):
        SchedulerConfig(max_prefill_wait_ms=-1)


def _full_batch(**knobs):
    """Two low-priority requests fill max_num_seqs=2; a high-priority one arrives."""
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=2, max_model_len=512, policy="priority",
                             **knobs)
    for r in create_requests(2, num_tokens=8, max_tokens=100, ignore_eos=True, priorities=[5, 5], prefix="low"):
        sched.add_request(r)
    step(sched)
    high = create_requests(1, num_tokens=8, max_tokens=3, ignore_eos=True, priorities=[0],
                           arrival_times=[10.0], prefix="high")[0]
    sched.add_request(high)
    return sched


def test_without_priority_preemption_the_high_priority_request_waits() -> None:
    sched = _full_batch()
    for _ in range(20):
        out, _ = step(sched)
        assert "high0" not in out.num_scheduled_tokens


def test_priority_preemption_admits_the_high_priority_request_next_step() -> None:
    sched = _full_batch(enable_priority_preemption=True)
    out, _ = step(sched)
    # The later-arriving of the two equal-priority requests goes (vLLM's victim order), and the
    # step that preempted admits nobody.
    assert out.preempted_req_ids == {"low1"} and "high0" not in out.num_scheduled_tokens
    assert out.policy_actions["priority_preemption"] == {"for": "high0", "preempted": ["low1"]}
    assert out.bound_by == "priority_preemption"
    out, _ = step(sched)
    assert out.num_scheduled_tokens["high0"] == 8
    while sched.has_unfinished_requests():
        step(sched)
    assert_scheduler_empty(sched)


def test_priority_preemption_never_for_equal_priority_and_protects_the_resumed() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=512, policy="priority",
                             enable_priority_preemption=True, priority_preemption_protection_steps=5)
    low = create_requests(1, num_tokens=4, max_tokens=200, ignore_eos=True, priorities=[5], prefix="low")[0]
    sched.add_request(low)
    step(sched)
    same = create_requests(1, num_tokens=4, max_tokens=5, ignore_eos=True, priorities=[5], arrival_times=[1.0],
                           prefix="same")[0]
    sched.add_request(same)
    out, _ = step(sched)
    assert not out.preempted_req_ids  # equal priority: never
    sched.finish_requests("same0", __import__("tokenloom.core.request", fromlist=["RequestStatus"])
                          .RequestStatus.FINISHED_ABORTED)
    # A high-priority one preempts low0; once it finishes low0 resumes and is protected for 5 steps
    # from a second high-priority arrival.
    sched.add_request(create_requests(1, num_tokens=4, max_tokens=2, ignore_eos=True, priorities=[0],
                                      arrival_times=[2.0], prefix="hi")[0])
    out, _ = step(sched)
    assert out.preempted_req_ids == {"low0"}
    for _ in range(3):
        step(sched)
    assert sched.running and sched.running[0].request_id == "low0"
    resumed_at = sched.num_schedule_calls
    sched.add_request(create_requests(1, num_tokens=4, max_tokens=2, ignore_eos=True, priorities=[0],
                                      arrival_times=[3.0], prefix="hj")[0])
    waited = 0
    while True:
        out, _ = step(sched)
        if out.preempted_req_ids:
            break
        waited += 1
    assert out.preempted_req_ids == {"low0"}
    assert sched.num_schedule_calls - 1 >= resumed_at + 5 - 1 and waited >= 3


@st.composite
def _policy_traces(draw):
    budget = draw(st.integers(8, 48))
    config = {
        "max_num_batched_tokens": budget,
        "max_num_seqs": draw(st.integers(1, 8)),
        "block_size": draw(st.sampled_from([2, 4, 8])),
        "num_blocks": draw(st.integers(16, 80)),
        "max_model_len": 128,
        "policy": "priority",
        "enable_prefix_caching": draw(st.booleans()),
        "max_prefill_wait_steps": draw(st.integers(1, 6)),
        "min_prefill_chunk": draw(st.integers(1, budget - 1)),
        "enable_priority_preemption": draw(st.booleans()),
        "priority_preemption_protection_steps": draw(st.integers(0, 6)),
    }
    # Lengths drawn as integers first: hypothesis keeps lists short, and short prompts are never starved.
    requests = [
        {"id": f"r{i}", "arrival_step": draw(st.integers(0, 15)),
         "prompt_token_ids": draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
         "max_tokens": draw(st.integers(1, 25)), "priority": draw(st.integers(0, 3))}
        for i in range(draw(st.integers(1, 10)))
        for n in [draw(st.integers(1, 60))]
    ]
    return {"config": config, "requests": requests}


# One full slot: r0 (priority 3) is preempted for hi0 at step 2, resumes once hi0 is done, and hi1 (priority 0)
# arrives inside its protection; "over" needs 21 of the 20 blocks of 2 tokens (41 tokens of KV) and is
# refused, "edge" needs all 20 and is served. Random traces reach these cases only now and then.
_PROTECTION_TRACE = {
    "config": {"max_num_batched_tokens": 16, "max_num_seqs": 1, "block_size": 2, "num_blocks": 20,
               "max_model_len": 128, "policy": "priority", "enable_prefix_caching": False,
               "max_prefill_wait_steps": 2, "min_prefill_chunk": 4, "enable_priority_preemption": True,
               "priority_preemption_protection_steps": 6},
    "requests": [
        {"id": "r0", "arrival_step": 0, "prompt_token_ids": [1] * 4, "max_tokens": 25, "priority": 3},
        {"id": "hi0", "arrival_step": 2, "prompt_token_ids": [2] * 4, "max_tokens": 2, "priority": 0},
        {"id": "hi1", "arrival_step": 7, "prompt_token_ids": [3] * 4, "max_tokens": 2, "priority": 0},
        {"id": "over", "arrival_step": 1, "prompt_token_ids": [0] * 30, "max_tokens": 12, "priority": 1},
        {"id": "edge", "arrival_step": 12, "prompt_token_ids": [0] * 30, "max_tokens": 11, "priority": 3},
    ],
}


# Two short blockers fill both slots; s (priority 3) waits from step 0 and is starved long before a slot
# frees; h (priority 0, arrives at step 4) is admitted first and stays ahead of s in the running order,
# within its own wait bound. Without the reserve h's 60-token prompt takes the whole budget: s is not
# admitted when it could be, then trickles behind h.
_STARVED_BEHIND_TRACE = {
    "config": {"max_num_batched_tokens": 16, "max_num_seqs": 2, "block_size": 4, "num_blocks": 80,
               "max_model_len": 128, "policy": "priority", "enable_prefix_caching": False,
               "max_prefill_wait_steps": 6, "min_prefill_chunk": 6, "enable_priority_preemption": False,
               "priority_preemption_protection_steps": 0},
    "requests": [
        {"id": "b1", "arrival_step": 0, "prompt_token_ids": [3], "max_tokens": 6, "priority": 0},
        {"id": "b2", "arrival_step": 0, "prompt_token_ids": [3], "max_tokens": 6, "priority": 0},
        {"id": "s", "arrival_step": 0, "prompt_token_ids": [2] * 60, "max_tokens": 4, "priority": 3},
        {"id": "h", "arrival_step": 4, "prompt_token_ids": [1] * 60, "max_tokens": 4, "priority": 0},
    ],
}


def test_policies_keep_the_invariants_and_their_guarantees() -> None:
    """Random priority traces with both policies on. Each guarantee is checked against state the test
    keeps itself (arrival steps, the policy's victims and when they resumed), not the scheduler's own,
    and each check must be reached often enough across the examples to mean something."""
    reached = {"starved": 0, "starved_head": 0, "policy_preempted": 0, "protection_tested": 0, "rejected": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None,
              derandomize=True)
    @given(_policy_traces())
    @example(_PROTECTION_TRACE)
    @example(_STARVED_BEHIND_TRACE)
    def check(trace) -> None:
        _check_policy_trace(trace, reached)

    check()
    # The 150 derandomized examples and _PROTECTION_TRACE reach each branch (starved hundreds of times, the
    # others a few to tens): the floors catch a strategy or a policy that stopped producing the case.
    assert reached["starved"] >= 20 and reached["starved_head"] >= 1 and reached["policy_preempted"] >= 5, reached
    assert reached["protection_tested"] >= 3 and reached["rejected"] >= 1, reached


def _check_policy_trace(trace: dict, reached: dict[str, int]) -> None:
    t = parse_trace(trace)
    cfg = t.scheduler_config
    sched = make_scheduler(cfg, t.cache_config, clock=lambda: 0.0)
    runner = ReplayRunner(sched)
    pending = sorted(t.requests, key=lambda r: (r.arrival_step, r.id))
    arrival: dict[str, int] = {}
    protected_from: dict[str, int] = {}  # request → step from which the policy may preempt it again
    victims: set[str] = set()  # preempted by the policy, not yet resumed
    block_size, num_blocks = t.cache_config.block_size, t.cache_config.num_blocks
    for step_no in range(3000):
        while pending and pending[0].arrival_step <= step_no:
            tr = pending.pop(0)
            # Refused exactly when it could never fit the pool: the KV of prompt + max_tokens - 1 tokens.
            never_fits = -(-(len(tr.prompt_token_ids) + tr.max_tokens - 1) // block_size) > num_blocks
            try:
                sched.add_request(Request(tr.id, tr.prompt_token_ids, SamplingParams(max_tokens=tr.max_tokens),
                                          float(step_no) + len(arrival) * 1e-3, tr.priority))
            except RequestRejected as exc:
                assert never_fits, exc
                assert "KV-cache blocks are needed" in str(exc), exc
                reached["rejected"] += 1
                continue
            assert not never_fits, f"{tr.id} can never fit {num_blocks} blocks of {block_size} but was accepted"
            arrival[tr.id] = step_no
        if not pending and not sched.has_unfinished_requests():
            break
        # Independently of the scheduler: which requests are starved going into this step?
        starved_running = [r for r in sched.running
                           if r.first_token_time is None and r.num_tokens > r.num_computed_tokens
                           and step_no - arrival[r.request_id] > cfg.max_prefill_wait_steps]
        # ... and is a request the policy may not preempt running below a blocked higher-priority head?
        head = sched.waiting.peek_request() if sched.waiting else None
        if head is not None and any(r.priority > head.priority and protected_from.get(r.request_id, -1) > step_no
                                    for r in sched.running):
            reached["protection_tested"] += 1
        starved_head = (head if head is not None and head.first_token_time is None
                        and head.num_tokens > head.num_computed_tokens and len(sched.running) < cfg.max_num_seqs
                        and step_no - arrival[head.request_id] > cfg.max_prefill_wait_steps else None)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        if out.preempted_req_ids:
            assert not out.scheduled_new_reqs, "a step that preempted admitted someone"
        # Guarantee 1: unless the step preempted (KV pressure), the first starved running prompt gets the
        # whole reserve, min_prefill_chunk tokens (or all the prompt work it has left, if less), whatever
        # the other running requests want.
        if starved_running and not out.preempted_req_ids:
            first = starved_running[0]
            got = out.num_scheduled_tokens.get(first.request_id, 0)
            left = first.num_tokens - first.num_computed_tokens + got  # schedule() advanced num_computed_tokens
            assert got >= min(cfg.min_prefill_chunk, left), (first.request_id, got, left, out.num_scheduled_tokens)
            reached["starved"] += 1
        # ... and when no running prompt is starved, a starved waiting head with a free slot is admitted
        # with the reserve (unless the step preempted, or the pool has no blocks for it).
        elif starved_head is not None and not out.preempted_req_ids:
            got = out.num_scheduled_tokens.get(starved_head.request_id, 0)
            if got == 0:
                assert out.bound_by == "kv_blocks", (starved_head.request_id, out.num_scheduled_tokens, out.bound_by)
            else:
                left = starved_head.num_tokens - starved_head.num_computed_tokens + got
                assert got >= min(cfg.min_prefill_chunk, left), (starved_head.request_id, got, left)
            reached["starved_head"] += 1
        # Guarantee 2: the policy preempts only strictly lower priorities, and not a request it preempted
        # before within priority_preemption_protection_steps of that request's resumption.
        action = out.policy_actions.get("priority_preemption")
        if action:
            head_priority = sched.requests[action["for"]].priority
            for rid in action["preempted"]:
                assert sched.requests[rid].priority > head_priority
                assert protected_from.get(rid, -1) <= step_no, (rid, step_no, protected_from)
                victims.add(rid)
                reached["policy_preempted"] += 1
        for new in out.scheduled_new_reqs:  # new and resumed requests alike
            if new.req_id in victims:  # resumed: protected from this step on
                victims.discard(new.req_id)
                protected_from[new.req_id] = step_no + cfg.priority_preemption_protection_steps
        _block_accounting(sched)
        sched.update_from_output(out, runner.execute_model(out))
        _block_accounting(sched)
    else:
        raise AssertionError("trace did not drain: some request never finished")
    assert_scheduler_empty(sched)


def test_default_knobs_replay_unchanged_and_actions_recorded() -> None:
    base = decodes_then_long_prompt({"max_num_batched_tokens": 16, "max_num_seqs": 16, "max_model_len": 256,
                                     "block_size": 4, "num_blocks": 400}, 15, 40, 40)
    default = replay(base)
    assert all("policy" not in s for s in default["steps"])
    bounded = replay({**base, "config": {**base["config"], "max_prefill_wait_steps": 3, "min_prefill_chunk": 5}})
    acted = [s for s in bounded["steps"] if "policy" in s]
    assert acted and acted[0]["policy"]["prefill_reserve"]["requests"] == ["long"]
    first_token = lambda steps: sum(s["scheduled"].get("long", 0) >= 1 for s in steps[:12])  # noqa: E731
    done = lambda steps: next(s["step"] for s in steps if "long" in s["finished"])  # noqa: E731
    assert first_token(bounded["steps"]) and done(bounded["steps"]) < done(default["steps"])


def test_explorer_presets_show_the_bounded_wait() -> None:
    from tokenloom.explore.presets import PRESETS
    from tokenloom.explore.scenario import run_scenario

    by_id = {p["id"]: p for p in PRESETS}
    default = run_scenario(by_id["decodes-leave-one-token"]["knobs"])
    bounded = run_scenario(by_id["bounded-prefill-wait"]["knobs"])
    assert default["prefill_done"] == {"p": 24} and bounded["prefill_done"] == {"p": 9}
    assert [s["scheduled"].get("p", 0) for s in bounded["steps"][:10]] == [0, 1, 1, 1, 4, 4, 4, 4, 4, 1]
