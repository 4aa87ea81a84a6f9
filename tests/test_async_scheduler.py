"""AsyncScheduler (vLLM 0.32's v1/core/sched/async_scheduler.py): placeholders, the max_tokens
guard, finish/abort with a step in flight, preemption with a step in flight, prefix caching, and
the async replay's call order. Worked examples: shared/reference/spec-async-vllm032.md §11 and
the upstream tests/v1/core/test_async_scheduler.py (0.27+ versions)."""

from __future__ import annotations

from collections import deque

import pytest

from tests.sched_utils import EOS_TOKEN_ID, create_requests, create_scheduler
from tokenloom.config import ConfigError, SchedulerConfig
from tokenloom.core.async_scheduler import AsyncScheduler
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.replay import replay
from tokenloom.core.request import Request, RequestStatus


def make_async(**kwargs) -> AsyncScheduler:
    scheduler = create_scheduler(async_scheduling=True, **kwargs)
    assert isinstance(scheduler, AsyncScheduler)
    return scheduler


def output_for(scheduler, so: SchedulerOutput, tokens: dict[str, list[int]] | None = None,
               token: int = 42) -> ModelRunnerOutput:  # fmt: skip
    """The runner's output for a batch, computed right after its schedule() (as a worker runs it)."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        if tokens and rid in tokens:
            sampled.append(list(tokens[rid]))
        else:
            sampled.append([] if req.is_prefill_chunk else [token])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


class BatchQueue:
    """vLLM's step_with_batch_queue, depth 2: schedule N+1, then process N."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.queue: deque = deque()
        self.scheduled: list[SchedulerOutput] = []
        self.outputs: list = []

    def step(self, tokens: dict[str, list[int]] | None = None) -> list:
        s = self.scheduler
        if s.has_requests():
            so = s.schedule()
            self.scheduled.append(so)
            self.queue.append((so, output_for(s, so, tokens)))
            if len(self.queue) < 2 and (not so.is_empty or s.has_unfinished_requests()):
                return []
        if not self.queue:
            return []
        so, out = self.queue.popleft()
        outs = s.update_from_output(so, out)
        self.outputs.extend(outs)
        return outs

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.queue:
                return
            self.step()
        raise AssertionError("did not finish")


# Checklist 22: total scheduled = prompt + max_tokens - 1 ------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_stop_by_max_tokens_schedules_prompt_plus_max_tokens_minus_one(max_tokens: int) -> None:
    scheduler = make_async()
    (req,) = create_requests(1, num_tokens=10, max_tokens=max_tokens)
    scheduler.add_request(req)
    q = BatchQueue(scheduler)
    q.run()
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.num_output_tokens == max_tokens
    assert sum(so.total_num_scheduled_tokens for so in q.scheduled) == 10 + max_tokens - 1
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == scheduler.kv_cache_manager.num_blocks


def test_worked_example_computed_and_placeholders() -> None:
    """§11: prompt 10, max_tokens=2: S1 → 10/1; S2 → 11/2; O1 → 11/1; S3 skipped by the guard; O2 ends it."""
    scheduler = make_async()
    (req,) = create_requests(1, num_tokens=10, max_tokens=2)
    scheduler.add_request(req)
    s1 = scheduler.schedule()
    assert (req.num_computed_tokens, req.num_output_placeholders) == (10, 1)
    s2 = scheduler.schedule()
    assert s2.num_scheduled_tokens == {"0": 1}
    assert (req.num_computed_tokens, req.num_output_placeholders) == (11, 2)
    scheduler.update_from_output(s1, output_for(scheduler, s1))
    assert (req.num_computed_tokens, req.num_output_placeholders) == (11, 1)
    s3 = scheduler.schedule()
    assert s3.num_scheduled_tokens == {}  # the guard: 11 + 2 - 1 >= 10 + 2
    outs = scheduler.update_from_output(s2, output_for(scheduler, s2))
    assert outs[0].finish_reason == "length" and req.num_output_placeholders == 0


# Checklist 20/21: placeholders grow by 1 (+drafts), shrink by appended, never negative ---------------


def test_placeholders_count_in_flight_tokens_and_never_go_negative() -> None:
    scheduler = make_async()
    reqs = create_requests(3, num_tokens=7, max_tokens=6)
    for r in reqs:
        scheduler.add_request(r)
    q = BatchQueue(scheduler)
    seen = set()
    while scheduler.has_requests() or q.queue:
        q.step()
        for r in reqs:
            assert r.num_output_placeholders >= 0
            if not r.is_finished():
                seen.add(r.num_output_placeholders)
                # Steady state: placeholders = steps in flight that will sample.
                assert r.num_output_placeholders == sum(
                    1 for so, _ in q.queue if r.request_id in so.num_scheduled_tokens
                )
    # Between engine steps one batch is in flight: every decoding request has one placeholder.
    assert seen == {1}
    assert all(r.num_output_tokens == 6 for r in reqs)


def test_a_prefill_chunk_gets_no_placeholder() -> None:
    scheduler = make_async(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=64)
    (req,) = create_requests(1, num_tokens=20, max_tokens=3)
    scheduler.add_request(req)
    scheduler.schedule()
    assert req.is_prefill_chunk and req.num_output_placeholders == 0
    scheduler.schedule()
    assert req.num_computed_tokens == 16 and req.num_output_placeholders == 0
    scheduler.schedule()  # the last 4 prompt tokens: this step samples
    assert req.num_computed_tokens == 20 and req.num_output_placeholders == 1


# Checklist 23: finish or abort while a later step is in flight -----------------------------------


def test_eos_with_a_step_in_flight_frees_blocks_at_once_and_drops_the_late_token() -> None:
    scheduler = make_async()
    (req,) = create_requests(1, num_tokens=10, max_tokens=10)
    scheduler.add_request(req)
    s1 = scheduler.schedule()
    s2 = scheduler.schedule()  # in flight when s1's EOS arrives
    outs = scheduler.update_from_output(s1, output_for(scheduler, s1, {"0": [EOS_TOKEN_ID]}))
    assert outs[0].finish_reason == "stop"
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks  # freed at output N
    s3 = scheduler.schedule()
    assert s3.finished_req_ids == {"0"}  # reported to the runner in the next schedule()
    late = scheduler.update_from_output(s2, ModelRunnerOutput(["0"], {"0": 0}, [[99]]))
    assert late == [] and req.output_token_ids == [EOS_TOKEN_ID]


def test_abort_in_flight_drops_output_and_keeps_counts() -> None:
    """Upstream test_abort: requests aborted after k outputs have exactly k outputs."""
    scheduler = make_async()
    reqs = create_requests(4, num_tokens=5, max_tokens=8)
    abort_after = {"0": 0, "1": 1, "2": 3, "3": 5}
    for r in reqs:
        scheduler.add_request(r)
    q = BatchQueue(scheduler)
    counts = {r.request_id: 0 for r in reqs}
    for _ in range(100):
        if not scheduler.has_requests() and not q.queue:
            break
        for o in q.step():
            counts[o.request_id] += len(o.new_token_ids)
        for rid, k in abort_after.items():
            if counts[rid] >= k and rid in scheduler.requests:
                scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    for rid, k in abort_after.items():
        assert counts[rid] == k
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks


# Checklist 24: preemption with a step in flight ----------------------------------------------------


def test_preemption_with_a_step_in_flight_appends_stale_output_without_touching_counters() -> None:
    # 2 requests of 8 tokens, blocks of 4: 6 usable blocks run out when both grow past 12 tokens.
    scheduler = make_async(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    reqs = create_requests(2, num_tokens=8, max_tokens=12)
    for r in reqs:
        scheduler.add_request(r)
    stale: list[tuple[str, int, int, int]] = []
    update = scheduler._update_request_with_output

    def spy(request, new_token_ids, is_stale=False):
        n_before = request.num_output_tokens
        result = update(request, new_token_ids, is_stale)
        if is_stale:
            stale.append((request.request_id, request.num_output_tokens - n_before, request.num_computed_tokens,
                          request.num_output_placeholders))
        return result

    scheduler._update_request_with_output = spy
    q = BatchQueue(scheduler)
    q.run(200)
    # Stale: appended (one token), but computed and placeholders stay as the preemption left them.
    stale_seen = bool(stale) and all(n == 1 and c == 0 and p == 0 for _, n, c, p in stale)
    assert scheduler.num_preemptions_total > 0 and stale_seen
    assert all(r.num_output_tokens == 12 for r in reqs)
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks


def test_reset_with_running_requests_drops_the_in_flight_output_and_resamples_its_position() -> None:
    """reset_prefix_cache(reset_running_requests=True) between steps preempts a request whose step is
    in flight and lets it resume at the next schedule, before that step's output lands: the output is
    dropped (vLLM's drop_stale_output), the resumed step samples the position again, so the request
    gets each position once and exactly max_tokens tokens (vLLM's test_reset_prefix_cache_e2e)."""
    scheduler = make_async(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    (req,) = create_requests(1, num_tokens=6, max_tokens=5)
    scheduler.add_request(req)
    first = scheduler.schedule()  # the prompt
    second = scheduler.schedule()  # its first decode, scheduled while the prompt is in flight
    scheduler.update_from_output(first, output_for(scheduler, first, token=7))
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    resumed = scheduler.schedule()  # at once: the decode's output has not landed
    assert resumed.num_scheduled_tokens == {req.request_id: 7}  # prompt + the one output known
    scheduler.update_from_output(second, output_for(scheduler, second, token=99))  # stale: dropped
    assert req.output_token_ids == [7]
    q = BatchQueue(scheduler)
    q.queue.append((resumed, output_for(scheduler, resumed, token=8)))
    q.run(50)
    assert req.output_token_ids == [7, 8, 42, 42, 42]
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks


def test_a_preempted_request_waits_for_its_deliverable_in_flight_output() -> None:
    """A request preempted with a step in flight whose output will be delivered (the default) is
    stepped over by admission until that output lands: resuming earlier could sample a position the
    output then fills (vLLM's rule). Prefix caching off: the resumed step recomputes everything."""
    scheduler = make_async(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                           enable_prefix_caching=False)
    (req,) = create_requests(1, num_tokens=6, max_tokens=5)
    scheduler.add_request(req)
    first = scheduler.schedule()
    scheduler.update_from_output(first, output_for(scheduler, first, token=7))
    second = scheduler.schedule()  # a decode, in flight
    scheduler._preempt_request(scheduler.running.pop(), 0.0)
    assert scheduler.schedule().num_scheduled_tokens == {}  # stepped over: its output is still to come
    scheduler.update_from_output(second, output_for(scheduler, second, token=8))  # delivered
    assert req.output_token_ids == [7, 8]
    assert scheduler.schedule().num_scheduled_tokens == {req.request_id: 8}  # resumes with both outputs


def test_reset_prefix_cache_with_a_step_in_flight_drops_its_output_and_tells_the_runner() -> None:
    """vLLM's rule (reset_prefix_cache preempts with drop_stale_output): the reset's requests may be resumed
    by the next schedule() before the step in flight returns, and the resume samples its positions again,
    so that step's token is dropped, not appended. The next output lists them as preempted, so the runner
    drops their state (vLLM's reset_preempted_req_ids)."""
    scheduler = make_async()
    (req,) = create_requests(1, num_tokens=10, max_tokens=5)
    scheduler.add_request(req)
    q = BatchQueue(scheduler)
    q.step()  # S1 (the prompt) in flight
    assert len(q.step()) == 1 and req.num_output_tokens == 1  # S2 in flight, S1's token in
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert q.step() == [] and req.num_output_tokens == 1  # S3 resumes it; S2's late token is dropped
    resumed = q.scheduled[2]
    assert resumed.preempted_req_ids == {"0"} and resumed.resumed_req_ids == {"0"}
    assert len(resumed.scheduled_new_reqs[0].prefill_token_ids) == 11
    q.run()
    assert q.scheduled[3].preempted_req_ids == set()
    assert req.num_output_tokens == 5 and sum(len(o.new_token_ids) for o in q.outputs) == 5


def test_preempt_upstream_output_count_equals_max_tokens() -> None:
    """Upstream test_preempt shape: every request still gets exactly max_tokens outputs."""
    scheduler = make_async(num_blocks=10, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    reqs = create_requests(4, num_tokens=6, max_tokens=7)
    for r in reqs:
        scheduler.add_request(r)
    q = BatchQueue(scheduler)
    q.run(500)
    counts: dict[str, int] = {}
    for o in q.outputs:
        counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
    assert counts == {r.request_id: 7 for r in reqs}
    assert scheduler.num_preemptions_total > 0


# Prefix caching: commits follow the known tokens ---------------------------------------------------


def test_prefix_cache_commits_generated_tokens_once_known() -> None:
    """Multi-turn shape: a follow-up prompt that extends prompt + outputs hits the generated blocks."""
    scheduler = make_async(block_size=4)
    (a,) = create_requests(1, num_tokens=6, max_tokens=6, prefix="a")
    scheduler.add_request(a)
    q = BatchQueue(scheduler)
    q.run()
    history = list(a.all_token_ids)  # 12 tokens; 11 were computed as inputs (2 full blocks of 4)
    b = Request("b", history + [5, 5], a.sampling_params, arrival_time=9.0)
    scheduler.add_request(b)
    so = scheduler.schedule()
    # The generated tokens were committed once their output came back: b hits both full blocks,
    # the second of which holds generated tokens.
    assert so.cached_tokens["b"] == 8


# Config and replay -------------------------------------------------------------------------------


def test_async_scheduling_needs_continuous_batching() -> None:
    with pytest.raises(ConfigError, match="async_scheduling needs batching='continuous'"):
        SchedulerConfig(async_scheduling=True, batching="static")
    with pytest.raises(ConfigError, match="async_scheduling must be true or false"):
        SchedulerConfig(async_scheduling="yes")  # type: ignore[arg-type]


def _trace(requests, **config):
    base = {"max_num_batched_tokens": 32, "max_num_seqs": 8, "block_size": 4, "num_blocks": 40,
            "max_model_len": 64, "enable_prefix_caching": False, "async_scheduling": True}  # fmt: skip
    base.update(config)
    return {"config": base, "requests": requests}


def test_replay_follows_the_batch_queue_call_order() -> None:
    result = replay(_trace([{"id": "A", "arrival_step": 0, "prompt_token_ids": list(range(100, 110)),
                             "max_tokens": 2}]))  # fmt: skip
    steps = result["steps"]
    assert [s["events"] for s in steps] == [
        ["schedule"], ["schedule", "update:0"], ["schedule", "update:1"], ["schedule", "update:2"], ["update:3"]
    ]
    assert [s["scheduled"] for s in steps] == [{"A": 10}, {"A": 1}, {}, {}, {}]
    assert [s["placeholders"] for s in steps] == [{"A": 1}, {"A": 1}, {}, {}, {}]
    assert [s["finished"] for s in steps] == [[], [], ["A"], [], []]
    assert result["summary"]["total_scheduled_tokens"] == 11


def test_replay_async_matches_sync_outputs_and_frees_everything() -> None:
    reqs = [{"id": f"r{i}", "arrival_step": i, "prompt_token_ids": [100 + i] * (3 + 2 * i), "max_tokens": 4 + i}
            for i in range(5)]  # fmt: skip
    a = replay(_trace(reqs, num_blocks=12))
    s = replay(_trace(reqs, num_blocks=12, async_scheduling=False))
    assert a["steps"][-1]["num_free_blocks"] == s["steps"][-1]["num_free_blocks"] == 12
    done = sorted(r for step in a["steps"] for r in step["finished"])
    assert done == sorted(r for step in s["steps"] for r in step["finished"]) == [f"r{i}" for i in range(5)]
    if a["summary"]["num_preemptions"] == 0:
        # The last token of each request is never an input: prompt + max_tokens - 1 each.
        assert a["summary"]["total_scheduled_tokens"] == sum(
            len(r["prompt_token_ids"]) + r["max_tokens"] - 1 for r in reqs
        )


def test_random_traces_finish_everything_and_free_every_block() -> None:
    """Property: under async replay (chunking, preemption, priority, prefix caching) every accepted
    request finishes, no placeholder is left and the whole pool is free again; some requests are
    finished by stale output right after being preempted."""
    import random

    finished_after_preemption = 0
    for seed in range(120):
        rng = random.Random(seed)
        reqs = [{"id": f"r{i}", "arrival_step": rng.randrange(0, 6),
                 "prompt_token_ids": [rng.randrange(100, 104) for _ in range(rng.randrange(1, 14))],
                 "max_tokens": rng.randrange(1, 12), "priority": rng.randrange(0, 3)}
                for i in range(rng.randrange(2, 7))]  # fmt: skip
        nb = rng.randrange(8, 30)
        result = replay(_trace(reqs, max_num_batched_tokens=rng.choice([8, 16, 32]),
                               max_num_seqs=rng.choice([2, 4, 8]), block_size=rng.choice([2, 4]), num_blocks=nb,
                               max_model_len=48, enable_prefix_caching=rng.random() < 0.5,
                               policy=rng.choice(["fcfs", "priority"])))  # fmt: skip
        steps = result["steps"]
        accepted = sorted(r["id"] for r in reqs if r["id"] not in result["summary"]["rejected"])
        assert sorted(f for s in steps for f in s["finished"]) == accepted, seed
        assert steps[-1]["num_free_blocks"] == nb and steps[-1]["placeholders"] == {}, seed
        finished_after_preemption += sum(
            1 for i, s in enumerate(steps) for f in s["finished"] if f in steps[i]["preempted"]
        )
    assert finished_after_preemption > 0
