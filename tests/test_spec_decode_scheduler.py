"""Speculative decoding in the scheduler: the checklist of shared/reference/spec-async-vllm032.md
(sync items), each case as vLLM 0.32's scheduler decides it (upstream tests/v1/core/test_scheduler.py)."""

from __future__ import annotations

import pytest

from tests.sched_utils import EOS_TOKEN_ID, create_requests
from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.replay import replay
from tokenloom.core.request import RequestStatus
from tokenloom.core.scheduler import Scheduler


def spec_scheduler(k: int = 3, max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                   num_blocks: int = 10000, block_size: int = 16, long_prefill_token_threshold: int = 0,
                   enable_prefix_caching: bool = True, max_num_seqs: int = 16) -> Scheduler:
    sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len or max_num_batched_tokens,
                            long_prefill_token_threshold=long_prefill_token_threshold)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k) if k else None
    return Scheduler(sched, cache, clock=lambda: 0.0, speculative_config=spec)


def output_for(so, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[list(sampled.get(r, [])) for r in req_ids])


# 1, 2, 3, 11, 14: drafts after update_from_output, 1+K scheduled, rollback, stats ---------------
@pytest.mark.parametrize(
    "spec,out,expected",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),
        ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),
        ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1, 0])),
        ([[1]], [[1, 2]], (1, 1, 1, [1, 0, 0])),
        ([[]], [[5]], None),
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),
    ],
)
def test_schedule_spec_decoding_stats(spec, out, expected):
    s = spec_scheduler(k=3)
    reqs = create_requests(len(spec), num_tokens=1)
    for r in reqs:
        s.add_request(r)
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {}
    s.update_from_output(so, output_for(so, {r.request_id: [0] for r in reqs}))
    s.update_draft_token_ids([r.request_id for r in reqs], spec)
    for r, drafts in zip(reqs, spec):
        assert r.num_computed_tokens == 1 and r.num_tokens == 2
        assert r.num_tokens_with_spec == 2 + len(drafts)
    so = s.schedule()
    for r, drafts in zip(reqs, spec):
        assert so.num_scheduled_tokens[r.request_id] == 1 + len(drafts)
        assert so.scheduled_spec_decode_tokens.get(r.request_id, []) == drafts
        assert r.spec_token_ids == []  # 3: scheduling clears them
    s.update_from_output(so, output_for(so, {r.request_id: o for r, o in zip(reqs, out)}))
    stats = s.spec_decoding_stats
    if expected is None:
        assert stats is None
    else:
        assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                stats.num_accepted_tokens_per_pos) == expected
    for r, o in zip(reqs, out):
        # 11: computed -= rejected; num_tokens += accepted + 1.
        assert r.num_tokens == 2 + len(o)
        assert r.num_computed_tokens == r.num_tokens - 1


def test_spec_decoding_stats_empty_output():
    # 12: an output with nothing sampled causes no rollback and no stats.
    s = spec_scheduler(k=3)
    (r,) = create_requests(1, num_tokens=1)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, output_for(so, {r.request_id: [0]}))
    s.update_draft_token_ids([r.request_id], [[1, 2]])
    so = s.schedule()
    assert so.num_scheduled_tokens[r.request_id] == 3
    s.update_from_output(so, output_for(so, {}))
    assert s.spec_decoding_stats is None
    assert r.num_computed_tokens == 4  # nothing taken back


def test_drafts_ignored_for_finished_and_prefill_chunks():
    # 2 and 6: prompt 80, budget 50 -> 50, then exactly 30 (drafts offered mid-prefill dropped), then 4.
    s = spec_scheduler(k=3, max_num_batched_tokens=50, max_model_len=200)
    (r,) = create_requests(1, num_tokens=80, max_tokens=10)
    s.add_request(r)
    so = s.schedule()
    assert so.num_scheduled_tokens == {r.request_id: 50}
    s.update_from_output(so, output_for(so, {}))
    s.update_draft_token_ids([r.request_id], [[1, 2, 3]])
    assert r.spec_token_ids == []
    so = s.schedule()
    assert so.num_scheduled_tokens == {r.request_id: 30} and not so.scheduled_spec_decode_tokens
    s.update_from_output(so, output_for(so, {r.request_id: [5]}))
    s.update_draft_token_ids([r.request_id], [[1, 2, 3]])
    so = s.schedule()
    assert so.num_scheduled_tokens == {r.request_id: 4}
    assert so.scheduled_spec_decode_tokens == {r.request_id: [1, 2, 3]}
    # A request that finished in the step ignores its drafts.
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    s.update_draft_token_ids([r.request_id], [[1]])


def test_budget_truncates_drafts():
    # 4: budget 6; R1 gets 4 (3 drafts), R2 gets 2 -> one draft; d2, d3 are lost.
    s = spec_scheduler(k=3, max_num_batched_tokens=6, max_model_len=64, max_num_seqs=2)
    r1, r2 = create_requests(2, num_tokens=2)
    for r in (r1, r2):
        s.add_request(r)
    so = s.schedule()  # 2 + 2 prompt tokens
    s.update_from_output(so, output_for(so, {r1.request_id: [0], r2.request_id: [0]}))
    s.update_draft_token_ids([r1.request_id, r2.request_id], [[1, 2, 3], [4, 5, 6]])
    so = s.schedule()
    assert so.num_scheduled_tokens == {r1.request_id: 4, r2.request_id: 2}
    assert so.scheduled_spec_decode_tokens == {r1.request_id: [1, 2, 3], r2.request_id: [4]}
    assert r2.spec_token_ids == []


def test_budget_of_zero_drafts_and_unreached_request_keeps_drafts():
    s = spec_scheduler(k=3, max_num_batched_tokens=5, max_model_len=64, max_num_seqs=2)
    r1, r2 = create_requests(2, num_tokens=2)
    for r in (r1, r2):
        s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, output_for(so, {r1.request_id: [0], r2.request_id: [0]}))
    s.update_draft_token_ids([r1.request_id, r2.request_id], [[1, 2, 3, 4], [4, 5, 6]])
    so = s.schedule()  # r1 takes all 5: r2 is never reached and keeps its drafts
    assert so.num_scheduled_tokens == {r1.request_id: 5}
    assert r2.spec_token_ids == [4, 5, 6]


def test_max_model_len_clamp_one_draft_short():
    # 5: computed 36, num_tokens 37, 3 drafts, max_model_len 40 -> 3 scheduled, 2 drafts.
    s = spec_scheduler(k=3, max_num_batched_tokens=64, max_model_len=40)
    (r,) = create_requests(1, num_tokens=36, max_tokens=4)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, output_for(so, {r.request_id: [0]}))
    s.update_draft_token_ids([r.request_id], [[1, 2, 3]])
    so = s.schedule()
    assert so.num_scheduled_tokens == {r.request_id: 3}
    assert so.scheduled_spec_decode_tokens == {r.request_id: [1, 2]}
    # A fully accepted run ends exactly on max_model_len.
    s.update_from_output(so, output_for(so, {r.request_id: [1, 2, 9]}))
    assert r.num_tokens == 40 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_padding_first_decode_step():
    # 7, 8: r2 shares r1's 33-token prompt and hits 32 cached tokens: scheduled 1 + 3 with [-1]*3.
    s = spec_scheduler(k=3, max_num_batched_tokens=100, max_model_len=100)
    r1, r2 = create_requests(2, num_tokens=33, same_prompt=True)
    s.add_request(r1)
    so = s.schedule()
    s.update_from_output(so, output_for(so, {r1.request_id: [0]}))
    s.update_draft_token_ids([r1.request_id], [[1, 2, 3]])
    s.add_request(r2)
    so = s.schedule()
    assert so.num_scheduled_tokens == {r1.request_id: 4, r2.request_id: 4}
    assert so.cached_tokens[r2.request_id] == 32
    assert so.scheduled_spec_decode_tokens == {r1.request_id: [1, 2, 3], r2.request_id: [-1, -1, -1]}
    # The padding is always rejected: 1 token out, computed back to num_tokens - 1, stats count it.
    s.update_from_output(so, output_for(so, {r1.request_id: [1, 2, 3, 4], r2.request_id: [7]}))
    assert r2.num_tokens == 34 and r2.num_computed_tokens == 33
    st = s.spec_decoding_stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 6, 3)


def test_padding_skipped_with_prefill_in_batch_and_budget_stops_admission():
    # A running prefill chunk in this step: no padding.
    s2 = spec_scheduler(k=3, max_num_batched_tokens=40, max_model_len=100)
    a, = create_requests(1, num_tokens=80, prefix="a")
    b1, b2 = create_requests(2, num_tokens=17, same_prompt=True, prefix="b")
    s2.add_request(b1)
    so = s2.schedule()
    s2.update_from_output(so, output_for(so, {b1.request_id: [0]}))
    s2.add_request(a)
    so = s2.schedule()  # b1: 1, a: 39 (chunk)
    s2.update_from_output(so, output_for(so, {b1.request_id: [0]}))
    s2.add_request(b2)
    so = s2.schedule()  # a is a running prefill chunk -> b2 (one token after a 16-token hit) unpadded
    assert so.num_scheduled_tokens[b2.request_id] == 1
    assert b2.request_id not in so.scheduled_spec_decode_tokens
    # Padding that does not fit the budget left stops admission (break).
    s3 = spec_scheduler(k=3, max_num_batched_tokens=8, max_model_len=100, max_num_seqs=4)
    c1, c2 = create_requests(2, num_tokens=17, same_prompt=True, prefix="c")
    d, = create_requests(1, num_tokens=2, prefix="d")
    s3.add_request(c1)
    for _ in range(3):
        so = s3.schedule()
        s3.update_from_output(so, output_for(so, {c1.request_id: [0]} if c1.num_computed_tokens >= c1.num_tokens
                                             else {}))
    s3.update_draft_token_ids([c1.request_id], [[1, 2, 3, 4, 5]])
    s3.add_request(c2)
    s3.add_request(d)
    so = s3.schedule()  # c1 takes 1 + 5 drafts; c2's padded 4 does not fit the 2 left: d waits too
    assert so.num_scheduled_tokens == {c1.request_id: 6}


def test_blocks_follow_slots_and_rejection_frees_nothing():
    # 9, 10: B=16, K=3: blocks 2 -> 3 -> 3; drafts never committed to the prefix cache.
    s = spec_scheduler(k=3, max_num_batched_tokens=64, max_model_len=128)
    (r,) = create_requests(1, num_tokens=30)
    s.add_request(r)
    kv = s.kv_cache_manager
    so = s.schedule()
    assert len(kv.req_to_blocks[r.request_id]) == 2
    s.update_from_output(so, output_for(so, {r.request_id: [5]}))
    s.update_draft_token_ids([r.request_id], [[1, 2, 3]])
    so = s.schedule()
    assert (r.num_computed_tokens, r.num_tokens, len(kv.req_to_blocks[r.request_id])) == (34, 31, 3)
    assert kv.num_cached_block[r.request_id] == 1  # min(computed + n, num_tokens) = 31 -> 1 full block
    free_before = kv.block_pool.get_num_free_blocks()
    s.update_from_output(so, output_for(so, {r.request_id: [1, 9]}))
    assert (r.num_computed_tokens, r.num_tokens) == (32, 33)
    assert kv.block_pool.get_num_free_blocks() == free_before
    s.update_draft_token_ids([r.request_id], [[1, 2, 3]])
    so = s.schedule()
    assert (r.num_computed_tokens, len(kv.req_to_blocks[r.request_id])) == (36, 3)
    assert kv.num_cached_block[r.request_id] == 2  # 33 verified tokens: 2 full blocks


@pytest.mark.parametrize(
    "drafts,sampled,params,expected,reason",
    [
        ([10, 42], [10, 42, 12], {"stop_token_ids": [42]}, [10, 42], "stop"),
        ([10, 11], [10, 11, 12], {"max_tokens": 2}, [10, 11], "length"),
        ([EOS_TOKEN_ID, 10], [EOS_TOKEN_ID, 10, 11], {"ignore_eos": True}, [EOS_TOKEN_ID, 10, 11], None),
        ([EOS_TOKEN_ID, 10], [EOS_TOKEN_ID, 10, 11], {}, [EOS_TOKEN_ID], "stop"),
    ],
)
def test_stop_inside_accepted_drafts(drafts, sampled, params, expected, reason):
    # 13: stop, EOS or max_tokens inside an accepted run trims; stats still count the untrimmed run.
    s = spec_scheduler(k=3)
    kwargs = {"max_tokens": 16, **params}
    (r,) = create_requests(1, num_tokens=3, max_tokens=kwargs.pop("max_tokens") + 1,
                           stop_token_ids=kwargs.get("stop_token_ids"), ignore_eos=kwargs.get("ignore_eos", False))
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, output_for(so, {r.request_id: [0]}))  # one output so far
    s.update_draft_token_ids([r.request_id], [drafts])
    so = s.schedule()
    outs = s.update_from_output(so, output_for(so, {r.request_id: sampled}))
    assert outs[0].new_token_ids == expected
    assert outs[0].finish_reason == reason
    if reason == "stop" and params.get("stop_token_ids"):
        assert outs[0].stop_reason == 42
    assert s.spec_decoding_stats.num_accepted_tokens == len(sampled) - 1
    if reason:
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == s.kv_cache_manager.num_blocks


def test_preemption_drops_drafts():
    # 19: a preempted request loses computed progress, placeholders and drafts.
    s = spec_scheduler(k=3, max_num_batched_tokens=64, max_model_len=64, num_blocks=5, block_size=4,
                       enable_prefix_caching=False)
    r1, r2 = create_requests(2, num_tokens=7, max_tokens=5)
    for r in (r1, r2):
        s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, output_for(so, {r1.request_id: [0], r2.request_id: [0]}))
    s.update_draft_token_ids([r1.request_id, r2.request_id], [[1, 2, 3], [4, 5, 6]])
    so = s.schedule()  # r1 takes the last free block for 7+4 slots; r2 then preempts itself
    assert r2.request_id in so.preempted_req_ids
    assert (r2.num_computed_tokens, r2.spec_token_ids, r2.num_output_placeholders) == (0, [], 0)
    assert r2.status == RequestStatus.PREEMPTED
    assert so.scheduled_spec_decode_tokens == {r1.request_id: [1, 2, 3]}


def test_long_prefill_threshold_below_one_plus_k_is_refused():
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=3"):
        spec_scheduler(k=3, long_prefill_token_threshold=3)
    spec_scheduler(k=3, long_prefill_token_threshold=4)


# Replay ---------------------------------------------------------------------------------------
def _trace(**config):
    base = {"max_num_batched_tokens": 6, "max_num_seqs": 2, "enable_chunked_prefill": True,
            "long_prefill_token_threshold": 0, "block_size": 4, "num_blocks": 199, "policy": "fcfs",
            "enable_prefix_caching": False, "max_model_len": 32, "num_speculative_tokens": 3}
    base.update(config)
    return base


def test_replay_spec_budget_example():
    trace = {"config": _trace(),
             "requests": [{"id": "R1", "arrival_step": 0, "prompt_token_ids": [100, 101, 102], "max_tokens": 8,
                           "drafts": [3], "accept": [1]},
                          {"id": "R2", "arrival_step": 0, "prompt_token_ids": [103, 104, 105], "max_tokens": 8,
                           "drafts": [3], "accept": [3]}]}
    out = replay(trace)
    steps = out["steps"]
    assert steps[0]["scheduled"] == {"R1": 3, "R2": 3} and steps[0]["spec"] == {}
    assert steps[0]["pending_drafts"] == {"R1": 3, "R2": 3}
    assert steps[1]["scheduled"] == {"R1": 4, "R2": 2}
    assert steps[1]["spec"] == {"R1": [3, 1], "R2": [1, 1]}
    sd = out["summary"]["spec_decoding"]
    assert sd["num_drafts"] == sum(len(s["spec"]) for s in steps)
    assert sd["num_accepted_tokens"] == sum(a for s in steps for _, a in s["spec"].values())


def test_replay_without_spec_keys_is_unchanged():
    trace = {"config": _trace(num_speculative_tokens=0),
             "requests": [{"id": "A", "arrival_step": 0, "prompt_token_ids": [100, 101], "max_tokens": 3}]}
    out = replay(trace)
    assert "spec" not in out["steps"][0] and "spec_decoding" not in out["summary"]


def test_speculative_config_validation():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).prompt_lookup_min == 5
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig(model="ngram", num_speculative_tokens=1).method == "ngram"
    for bad, field in [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "prompt_lookup_min=4"),
        ('{"method": "nope", "num_speculative_tokens": 2}', "method"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"num_speculative_tokens": 2}', "draft model"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "foo"),
        ('{"method": "ngram", ', "not valid JSON"),
        ('[1]', "JSON object"),
    ]:
        with pytest.raises(ConfigError, match=field):
            SpeculativeConfig.from_any(bad)


def test_replay_padding_after_prefix_hit_is_always_rejected():
    prompt = list(range(100, 109))  # 9 tokens: two full blocks of 4 can hit
    trace = {"config": _trace(max_num_batched_tokens=32, enable_prefix_caching=True, num_speculative_tokens=2),
             "requests": [{"id": "A", "arrival_step": 0, "prompt_token_ids": prompt, "max_tokens": 6,
                           "drafts": [2], "accept": [2]},
                          {"id": "B", "arrival_step": 2, "prompt_token_ids": prompt, "max_tokens": 3,
                           "drafts": [0], "accept": [2]}]}
    steps = replay(trace)["steps"]
    b_first = next(s for s in steps if "B" in s["scheduled"])
    assert b_first["cached_tokens"]["B"] == 8
    assert b_first["scheduled"]["B"] == 3 and b_first["spec"]["B"] == [2, 0]  # padded, never accepted


def test_replay_max_model_len_one_draft_short():
    trace = {"config": _trace(max_num_batched_tokens=32, max_model_len=12, num_speculative_tokens=3),
             "requests": [{"id": "A", "arrival_step": 0, "prompt_token_ids": list(range(100, 108)),
                           "max_tokens": 10, "drafts": [3], "accept": [3]}]}
    out = replay(trace)
    steps = out["steps"]
    # 8 prompt tokens -> 9; the proposer offers min(3, 12 - 9) = 3 drafts, the clamp allows 12 - 8 - 1 = 3
    # tokens: 2 drafts; all accepted -> 12 tokens = max_model_len: finished by length.
    assert steps[1]["scheduled"] == {"A": 3} and steps[1]["spec"] == {"A": [2, 2]}
    assert steps[1]["finished"] == ["A"]
    assert out["summary"]["spec_decoding"]["num_draft_tokens"] == 2
