"""Property tests of the invariants in design.md over random traces (hypothesis)."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.replay import ReplayRunner, replay
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import RequestRejected, Scheduler
from tokenloom.core.schedulers import make_scheduler
from tokenloom.sampling_params import SamplingParams


@st.composite
def traces(draw):
    max_num_seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(max_num_seqs, 64))
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(8, 96))
    if not chunked:
        budget = max(budget, max_model_len)
    config = {
        "max_num_batched_tokens": budget,
        "max_num_seqs": max_num_seqs,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 3, 8])),
        "block_size": draw(st.sampled_from([1, 2, 4, 8])),
        "num_blocks": draw(st.integers(4, 40)),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.booleans()),
        "max_model_len": max_model_len,
        "scheduler_reserve_full_isl": draw(st.booleans()),
    }
    n = draw(st.integers(1, 10))
    # A tiny vocabulary and shared stems make prefix hits common.
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]
    requests = []
    for i in range(n):
        stem = draw(st.sampled_from(stems))
        tail = draw(st.lists(st.integers(0, 3), min_size=0, max_size=40))
        requests.append({
            "id": f"r{i}",
            "arrival_step": draw(st.integers(0, 12)),
            "prompt_token_ids": stem + tail,
            "max_tokens": draw(st.integers(1, 20)),
            "priority": draw(st.integers(0, 3)),
        })
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, n - 1)), max_size=3))
    return {"config": config, "requests": requests}, aborts


def _block_accounting(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    owners = Counter()
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            owners[b.block_id] += 1
    for b in kv.block_pool.blocks:
        assert b.ref_cnt == owners[b.block_id], f"ref_cnt of block {b.block_id} disagrees with owners"
    assert kv.block_pool.get_num_free_blocks() + len(owners) == kv.num_blocks
    live = {rid for rid, r in sched.requests.items() if r.status == RequestStatus.RUNNING}
    assert set(kv.req_to_blocks) <= live


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_invariants_hold_on_random_traces(case) -> None:
    trace, aborts = case
    from tokenloom.core.replay import parse_trace

    t = parse_trace(trace)
    sched = make_scheduler(t.scheduler_config, t.cache_config, clock=lambda: 0.0)
    runner = ReplayRunner(sched)
    cfg: SchedulerConfig = t.scheduler_config
    pending = sorted(t.requests, key=lambda r: r.arrival_step)
    admitted: set[str] = set()
    finished: set[str] = set()
    seq = 0
    for step in range(2000):
        while pending and pending[0].arrival_step <= step:
            tr = pending.pop(0)
            seq += 1
            try:
                sched.add_request(Request(tr.id, tr.prompt_token_ids, SamplingParams(max_tokens=tr.max_tokens),
                                          float(seq), tr.priority))
                admitted.add(tr.id)
            except RequestRejected:
                pass
        for when, idx in aborts:
            if when == step:
                finished |= {r.request_id for r in sched.finish_requests(f"r{idx}", RequestStatus.FINISHED_ABORTED)}
        if not pending and not sched.has_unfinished_requests():
            break
        before = {rid: (r.num_computed_tokens, r.num_tokens_with_spec) for rid, r in sched.requests.items()}
        out = sched.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        for rid, n in out.num_scheduled_tokens.items():
            computed, total = before[rid]
            if rid in {d.req_id for d in out.scheduled_new_reqs}:
                computed = next(d.num_computed_tokens for d in out.scheduled_new_reqs if d.req_id == rid)
            assert 0 < n <= total - computed
            assert sched.requests[rid].num_computed_tokens <= sched.requests[rid].num_tokens_with_spec
        if out.preempted_req_ids:
            assert not out.scheduled_new_reqs, "a step that preempted admitted someone"
        _block_accounting(sched)
        outs = sched.update_from_output(out, runner.execute_model(out))
        finished |= {o.request_id for o in outs if o.finished}
        _block_accounting(sched)
    else:
        raise AssertionError("trace did not drain: some request never finished")
    assert admitted <= finished
    kv = sched.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks


@settings(max_examples=40, deadline=None)
@given(traces())
def test_replay_is_deterministic(case) -> None:
    trace, _ = case
    assert replay(trace) == replay(trace)


def test_allocate_slots_is_all_or_nothing_under_random_calls() -> None:
    import random

    rng = random.Random(0)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
                      CacheConfig(block_size=4, num_blocks=12), clock=lambda: 0.0)
    kv = sched.kv_cache_manager
    for i in range(300):
        req = Request(f"x{i}", [rng.randrange(3) for _ in range(rng.randrange(1, 40))], SamplingParams())
        req.set_block_size(4)
        blocks, hit = kv.get_computed_blocks(req)
        snapshot = ([(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks],
                    [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()])
        got = kv.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        if got is None:
            assert snapshot == ([(b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks],
                                [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()])
        elif rng.random() < 0.7:
            kv.free(req)
    assert kv.block_pool.get_num_free_blocks() + sum(1 for b in kv.block_pool.blocks if b.ref_cnt) == 12
