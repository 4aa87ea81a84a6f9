"""Scheduler behaviours, after vLLM's tests/v1/core/test_scheduler.py (as behaviours, our own code)."""

from __future__ import annotations

import pytest

from tests.sched_utils import (
    EOS_TOKEN_ID,
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    runner_output,
    step,
)
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import RequestRejected
from tokenloom.sampling_params import SamplingParams


def drain(sched, max_steps: int = 10_000) -> int:
    n = 0
    while sched.has_unfinished_requests():
        step(sched)
        n += 1
        assert n < max_steps, "scheduler did not drain"
    return n


def test_add_and_schedule_all() -> None:
    sched = create_scheduler()
    reqs = create_requests(10)
    for i, r in enumerate(reqs):
        sched.add_request(r)
        assert len(sched.waiting) == i + 1 and sched.requests[r.request_id] is r
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == [r.request_id for r in reqs]
    assert all(out.num_scheduled_tokens[r.request_id] == 10 for r in reqs)
    assert not sched.waiting and sched.running == reqs


def test_finish_request_removes_everywhere() -> None:
    sched = create_scheduler()
    reqs = create_requests(10)
    for r in reqs:
        sched.add_request(r)
    sched.schedule()  # all running now
    extra = create_requests(2, prefix="w")
    for r in extra:
        sched.add_request(r)
    aborted = sched.finish_requests(["0", "w1", "missing"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in aborted} == {"0", "w1"}
    assert "0" not in sched.requests and reqs[0] not in sched.running
    assert [r.request_id for r in sched.waiting] == ["w0"]
    assert sched.get_num_unfinished_requests() == 10
    assert sched.kv_cache_manager.get_block_ids("0") == ([],)  # blocks freed at once
    out = sched.schedule()
    assert "0" in out.finished_req_ids  # the runner is told to drop its state


def test_concurrent_partial_requests_threshold() -> None:
    """vLLM test_schedule_concurrent_partial_requests: budget 1024, threshold 400, 3x800 tokens."""
    for caching in (True, False):
        sched = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                                 max_model_len=1024, enable_prefix_caching=caching)
        for r in create_requests(3, num_tokens=800):
            sched.add_request(r)
        expected = [[400, 400, 224], [400, 400, 224], [1, 1, 352]]
        for want in expected:
            out, _ = step(sched)
            assert [out.num_scheduled_tokens.get(str(i), 0) for i in range(3)] == want


def test_threshold_is_lifted_for_a_lone_request() -> None:
    """vLLM 0.32: with a single eligible request nobody can be starved, so it takes the whole budget."""
    sched = create_scheduler(max_num_batched_tokens=512, long_prefill_token_threshold=100, max_model_len=2048)
    sched.add_request(create_requests(1, num_tokens=800)[0])
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"0": 512}


def test_max_num_seqs_caps_admission() -> None:
    sched = create_scheduler(max_num_batched_tokens=100, max_num_seqs=2)
    for r in create_requests(3, num_tokens=10):
        sched.add_request(r)
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) == 2 and len(sched.waiting) == 1
    assert out.bound_by == "max_num_seqs"
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)


def test_fcfs_preempts_last_running_and_recomputes() -> None:
    """vLLM test_preempt_during_execution: 10 blocks of 16, two 80-token prompts (5 blocks each)."""
    sched = create_scheduler(max_num_batched_tokens=100, num_blocks=10, block_size=16, max_model_len=200)
    r0, r1 = create_requests(2, num_tokens=80, max_tokens=30)
    sched.add_request(r0)
    sched.add_request(r1)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"0": 80, "1": 20}
    out, _ = step(sched)  # r0 needs a 6th block for position 80: the pool is full
    assert out.preempted_req_ids == {"1"}
    assert sched.running == [r0] and r1.status == RequestStatus.PREEMPTED
    assert r1.num_computed_tokens == 0 and r1.num_preemptions == 1
    assert list(sched.waiting) == [r1]
    assert out.num_scheduled_tokens == {"0": 1}  # nobody admitted in a step that preempted
    assert out.bound_by == "kv_blocks"
    drain(sched)
    assert r0.num_output_tokens == 30 and r1.num_output_tokens == 30
    assert_scheduler_empty(sched)


def test_preempted_request_resumes_with_its_outputs() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, num_blocks=5, block_size=16, max_model_len=200,
                             enable_prefix_caching=False)
    r0, r1 = create_requests(2, num_tokens=30, max_tokens=40)
    for r in (r0, r1):
        sched.add_request(r)
    seen_resume = False
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            if new.req_id in out.resumed_req_ids:
                seen_resume = True
                req = r0 if new.req_id == "0" else r1
                # Recompute: prompt plus every output so far, from position 0.
                assert new.num_computed_tokens == 0
                assert new.prefill_token_ids == req.prompt_token_ids + req.output_token_ids
        sched.update_from_output(out, runner_output(sched, out))
    assert seen_resume
    assert r0.num_output_tokens == r1.num_output_tokens == 40
    assert_scheduler_empty(sched)


def test_victim_is_the_request_itself() -> None:
    """FCFS picks the last running request as the victim; when that is the request asking for a block,
    it preempts itself (vLLM: `if preempted_req == request: break`) and the one before it goes on.
    Pool 4 blocks x 4: a (5-token prompt) and b (6) take two blocks each; b reaches position 8 first."""
    sched = create_scheduler(max_num_batched_tokens=64, num_blocks=4, block_size=4, max_model_len=64,
                             enable_prefix_caching=False)
    params = create_requests(1, max_tokens=10)[0].sampling_params
    a, b = Request("0", [0] * 5, params, arrival_time=0.0), Request("1", [1] * 6, params, arrival_time=1.0)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(10):
        out, _ = step(sched)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"1"}, "b should have been its own victim"
    assert out.num_scheduled_tokens == {"0": 1}  # a decodes in the very step b gave up its blocks
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    assert sched.running == [a] and list(sched.waiting) == [b] and b.num_computed_tokens == 0
    drain(sched)
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert_scheduler_empty(sched)


def test_priority_order_and_tiebreaks() -> None:
    sched = create_scheduler(policy="priority")
    for r in create_requests(3, priorities=[2, 0, 1]):
        sched.add_request(r)
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["1", "2", "0"]

    sched = create_scheduler(policy="priority")
    for r in create_requests(4, priorities=[2, 1, 1, 0], arrival_times=[1, 3, 2, 4]):
        sched.add_request(r)
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["3", "2", "1", "0"]


def test_priority_limited_slots_and_heap_order() -> None:
    sched = create_scheduler(policy="priority", max_num_seqs=2)
    for r in create_requests(4, priorities=[3, 2, 0, 1]):
        sched.add_request(r)
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["2", "3"]
    assert [r.request_id for r in sched.waiting] == ["1", "0"]

    sched = create_scheduler(policy="priority", max_num_seqs=1)
    prios = [5, 1, 8, 3, 2, 7, 4, 6]
    for r in create_requests(8, priorities=prios, max_tokens=1):
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        order += [d.req_id for d in out.scheduled_new_reqs]
    assert [prios[int(i)] for i in order] == sorted(prios)


def test_priority_preemption_picks_lowest_priority() -> None:
    """vLLM test_priority_scheduling_preemption: the high-priority request keeps running."""
    sched = create_scheduler(policy="priority", max_num_batched_tokens=100, num_blocks=5, block_size=16,
                             max_model_len=200)
    (lo,) = create_requests(1, num_tokens=32, max_tokens=40, priorities=[5], prefix="lo")
    sched.add_request(lo)
    step(sched)
    (hi,) = create_requests(1, num_tokens=32, max_tokens=40, priorities=[0], arrival_times=[9.0], prefix="hi")
    sched.add_request(hi)
    out, _ = step(sched)
    assert "hi0" in out.num_scheduled_tokens
    preempted = set()
    for _ in range(40):
        out, _ = step(sched)
        preempted |= out.preempted_req_ids
        if preempted:
            break
    assert preempted == {"lo0"}
    assert lo.status == RequestStatus.PREEMPTED and hi in sched.running
    drain(sched)
    assert_scheduler_empty(sched)


def test_priority_victim_already_scheduled_this_step_is_undone() -> None:
    """Priority: the victim may sit earlier in running and be scheduled already; its tokens go back."""
    sched = create_scheduler(policy="priority", max_num_batched_tokens=100, num_blocks=6, block_size=4,
                             max_model_len=100)
    (lo,) = create_requests(1, num_tokens=4, max_tokens=20, priorities=[9], prefix="lo")
    (hi,) = create_requests(1, num_tokens=4, max_tokens=20, priorities=[0], arrival_times=[5.0], prefix="hi")
    sched.add_request(lo)
    step(sched)
    sched.add_request(hi)
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"lo0"}
            assert "lo0" not in out.num_scheduled_tokens
            assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
            break
    else:
        pytest.fail("expected a preemption")
    drain(sched)
    assert_scheduler_empty(sched)


def test_stop_conditions() -> None:
    sched = create_scheduler()
    eos, stop_tok, length, ignore = (
        create_requests(1, prefix="eos")[0],
        create_requests(1, prefix="stop", stop_token_ids=[42])[0],
        create_requests(1, prefix="len", max_tokens=2)[0],
        create_requests(1, prefix="ign", ignore_eos=True, max_tokens=3)[0],
    )
    for r in (eos, stop_tok, length, ignore):
        sched.add_request(r)
    out = sched.schedule()
    tokens = {"eos0": [EOS_TOKEN_ID], "stop0": [10, 42, 12], "len0": [10, 11, 12], "ign0": [EOS_TOKEN_ID]}
    results = {o.request_id: o for o in sched.update_from_output(out, runner_output(sched, out, tokens=tokens))}
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [EOS_TOKEN_ID]
    assert stop_tok.stop_reason == 42 and stop_tok.output_token_ids == [10, 42]
    assert results["stop0"].new_token_ids == [10, 42] and results["stop0"].finish_reason == "stop"
    assert length.status == RequestStatus.FINISHED_LENGTH_CAPPED and length.output_token_ids == [10, 11]
    assert results["len0"].finish_reason == "length"
    assert ignore.status == RequestStatus.RUNNING and "ign0" not in out.finished_req_ids
    assert sched.running == [ignore]


def test_min_tokens_is_the_samplers_a_sampled_stop_token_still_stops() -> None:
    """vLLM 0.32's check_stop: below min_tokens other tokens go on, but a stop token the sampler let through
    (it masks them while too few outputs exist) ends the request; the sampler's own mask is
    tests/test_sampler.py's. The stop check kept a min_tokens backstop before 2026-12-06."""
    sched = create_scheduler()
    (r,) = create_requests(1, min_tokens=3, stop_token_ids=[42])
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out, token=7))
    assert not r.is_finished()
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out, token=42))
    assert r.num_output_tokens == 2 and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_max_model_len_caps_length() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_model_len=20)
    (r,) = create_requests(1, num_tokens=15, max_tokens=100)
    sched.add_request(r)
    drain(sched)
    assert r.num_tokens == 20 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_rejections_are_clear() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_model_len=32, num_blocks=4, block_size=4)
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(RequestRejected, match="maximum context length is 32 tokens"):
        sched.add_request(Request("long", [1] * 32, SamplingParams()))
    with pytest.raises(RequestRejected, match="8 KV-cache blocks are needed"):
        sched.add_request(Request("big", [1] * 10, SamplingParams(max_tokens=20)))
    sched.add_request(Request("ok", [1] * 10, SamplingParams(max_tokens=7)))  # 16 tokens = 4 blocks
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add_request(Request("ok", [1] * 10, SamplingParams(max_tokens=7)))
    assert list(sched.requests) == ["ok"]


def test_prefix_hit_schedules_only_the_suffix() -> None:
    """Two identical 33-token prompts with block 16: the second hits 32 and computes exactly 1."""
    sched = create_scheduler(block_size=16)
    a, b = create_requests(2, num_tokens=33, same_prompt=True)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    out, _ = step(sched)
    assert out.num_scheduled_tokens["1"] == 1 and out.cached_tokens == {"1": 32}
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 32 and new.block_ids[0][:2] == sched.kv_cache_manager.get_block_ids("0")[0][:2]
    assert b.num_cached_tokens == 32
    stats = sched.make_stats().prefix_cache_stats  # the steps' intervals since start
    assert (stats.requests, stats.queries, stats.hits) == (2, 66, 32)
    assert sched.kv_cache_manager.prefix_cache_stats.queries == 0  # each step ended its interval (vLLM)


def test_prefix_stats_only_counted_on_admission() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=1, block_size=16)
    a, b = create_requests(2, num_tokens=33, same_prompt=True, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # b waits: max_num_seqs
    assert sched.make_stats().prefix_cache_stats.requests == 1
    drain(sched)
    stats = sched.make_stats().prefix_cache_stats
    assert (stats.requests, stats.hits) == (1, 32)  # b alone, once, though it waited several steps


def test_failed_request_finishes_with_error_others_go_on() -> None:
    sched = create_scheduler()
    reqs = create_requests(3)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    mro = runner_output(sched, out)
    mro = ModelRunnerOutput(mro.req_ids, mro.req_id_to_index, mro.sampled_token_ids, failed={"1": "bad token"})
    results = {o.request_id: o for o in sched.update_from_output(out, mro)}
    assert results["1"].finish_reason == "error" and results["1"].error == "bad token"
    assert reqs[1].status == RequestStatus.FINISHED_ERROR and reqs[1] not in sched.running
    drain(sched)
    assert reqs[0].num_output_tokens == 16 and reqs[2].num_output_tokens == 16
    assert_scheduler_empty(sched)


def test_memory_leak_free_after_drain() -> None:
    sched = create_scheduler(max_num_batched_tokens=256, num_blocks=64, block_size=16, max_model_len=512)
    for r in create_requests(20, num_tokens=40, max_tokens=25):
        sched.add_request(r)
    drain(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("mode", ["static", "request"])
def test_batching_modes_release_slots_at_batch_end(mode: str) -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=2, batching=mode)
    short, long_ = create_requests(2, num_tokens=4, max_tokens=2)[0], create_requests(1, num_tokens=4, max_tokens=6,
                                                                                       prefix="L")[0]
    late = create_requests(1, num_tokens=4, max_tokens=2, prefix="late")[0]
    sched.add_request(short)
    sched.add_request(long_)
    sched.add_request(late)
    admitted_at = {}
    n = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        for d in out.scheduled_new_reqs:
            admitted_at[d.req_id] = n
        n += 1
    # "late" waits for the whole first batch, although short0 finished long before.
    assert admitted_at["late0"] > admitted_at["L0"] + 5
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("mode", ["static", "request"])
def test_batching_modes_survive_an_abort(mode: str) -> None:
    """An abort (a client that disconnects) ends a batch member like a finish: the next batch forms once the
    rest is done. (Before the batching modes became a policy, their scheduler's free hook did not take
    finish_requests' arguments: every abort under --batching static|request raised TypeError.)"""
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=2, batching=mode)
    first, second, late = create_requests(3, num_tokens=4, max_tokens=4, ignore_eos=True)
    for r in (first, second, late):
        sched.add_request(r)
    step(sched)
    sched.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    scheduled = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        scheduled.append(set(out.num_scheduled_tokens))
    assert late.request_id not in set().union(*scheduled[:3])  # "1" still runs its batch out
    assert any(late.request_id in ids for ids in scheduled)
    assert_scheduler_empty(sched)


def test_continuous_batching_fills_a_freed_slot_next_step() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    short = create_requests(1, num_tokens=4, max_tokens=2)[0]
    long_ = create_requests(1, num_tokens=4, max_tokens=6, prefix="L")[0]
    late = create_requests(1, num_tokens=4, max_tokens=2, prefix="late")[0]
    for r in (short, long_, late):
        sched.add_request(r)
    finished_step = admitted_step = None
    for n in range(20):
        out, outs = step(sched)
        if any(o.request_id == "0" and o.finished for o in outs):
            finished_step = n
        if any(d.req_id == "late0" for d in out.scheduled_new_reqs):
            admitted_step = n
            break
    assert admitted_step == finished_step + 1


def test_static_batching_prefills_before_decoding() -> None:
    sched = create_scheduler(max_num_batched_tokens=16, max_num_seqs=4, batching="static")
    for r in create_requests(3, num_tokens=10, max_tokens=3):
        sched.add_request(r)
    out, _ = step(sched)  # 10 + 6: request 1 half done; request 0 has its first token
    assert out.num_scheduled_tokens == {"0": 10, "1": 6}
    out, _ = step(sched)  # no decode for 0 until every member has its first token
    assert "0" not in out.num_scheduled_tokens


def test_prefix_cache_stats_are_per_interval_and_count_resumed_requests_apart() -> None:
    """vLLM semantics: make_stats() hands over this interval's lookups and starts a new interval; a
    request resumed after preemption is counted in preempted_*; the Prometheus totals keep growing."""
    sched = create_scheduler(max_num_batched_tokens=64, block_size=16)
    a, b = create_requests(2, num_tokens=33, same_prompt=True, max_tokens=3)
    sched.add_request(a)
    step(sched)
    first = sched.make_stats()
    assert (first.prefix_cache_stats.requests, first.prefix_cache_stats.queries) == (1, 33)
    sched.add_request(b)
    step(sched)
    second = sched.make_stats()
    assert (second.prefix_cache_stats.requests, second.prefix_cache_stats.hits) == (1, 32)  # only b
    assert (second.prefix_cache_queries, second.prefix_cache_hits) == (66, 32)  # totals since start
    assert sched.reset_prefix_cache(reset_running_requests=True)  # both back to waiting, blocks freed
    assert [r.request_id for r in sched.waiting] == ["0", "1"] and not sched.running
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sched.kv_cache_manager.num_blocks
    step(sched)
    third = sched.make_stats()
    s = third.prefix_cache_stats
    assert s.reset and (s.requests, s.preempted_requests) == (0, 2) and s.preempted_queries > 0
    assert third.prefix_cache_queries == 66  # resumed lookups stay out of the new-request totals


def test_the_configuration_picks_the_scheduler_class() -> None:
    from tokenloom.config import CacheConfig, SchedulerConfig
    from tokenloom.core.async_scheduler import AsyncScheduler
    from tokenloom.core.batch_policy import BatchFormation
    from tokenloom.core.scheduler import Scheduler
    from tokenloom.core.scheduler_factory import make_scheduler

    cache = CacheConfig(block_size=16, num_blocks=64)
    assert type(make_scheduler(SchedulerConfig(max_model_len=64), cache)) is Scheduler
    assert type(make_scheduler(SchedulerConfig(max_model_len=64, async_scheduling=True), cache)) is AsyncScheduler
    for mode in ("static", "request"):
        # The comparison modes are a policy of the one scheduler, not a subclass of it.
        sched = make_scheduler(SchedulerConfig(max_model_len=64, batching=mode), cache)
        assert type(sched) is Scheduler and isinstance(sched.batch_formation, BatchFormation)
        assert sched.batch_formation.lockstep == (mode == "static")


def test_preempted_req_ids_are_this_steps_preemptions() -> None:
    sched = create_scheduler(max_num_batched_tokens=64, max_num_seqs=4, num_blocks=4, block_size=4)
    for r in create_requests(2, num_tokens=7, max_tokens=10):
        sched.add_request(r)
    preempted = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        preempted.append(out.preempted_req_ids)
    assert any(preempted) and all(len(p) <= 1 for p in preempted)
    assert all(not p or next(iter(p)) == "1" for p in preempted)  # FCFS: the last of running
