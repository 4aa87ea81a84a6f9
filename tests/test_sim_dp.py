"""The data-parallel simulator: N simulated engines behind the router on one virtual clock.

Deterministic figures (a pinned copy of the default profile's cost model, the shared-prefix workload of
docs/data_parallel.md): cache-aware routing keeps the prefix cache hit where round robin thrashes it,
a hot group does not pile onto one engine under load, and one engine simulates as `simulate` does.
"""

from __future__ import annotations

import math

import pytest

from tests.sched_utils import PINNED_SIM_PROFILE
from tokenloom.router import RouterConfig
from tokenloom.sim.dp_simulate import simulate_dp
from tokenloom.sim.profile import load_profile
from tokenloom.sim.simulate import engine_configs, simulate
from tokenloom.workload.datasets import assign_arrivals
from tokenloom.workload.shared_prefix import group_of, shared_prefix_requests


@pytest.fixture(scope="module")
def profile():
    return load_profile(PINNED_SIM_PROFILE)


def _run(profile, policy, dp=2, rate=4.0, num_blocks=256, **workload):
    requests = assign_arrivals(shared_prefix_requests(**workload), rate, 1.0, 0)
    sched, cache = engine_configs(profile, {"num_blocks": num_blocks, "block_size": 16})
    return simulate_dp(requests, sched, cache, profile.step_model, dp, RouterConfig(policy=policy))


def test_shared_prefix_workload_shape():
    reqs = shared_prefix_requests(num_groups=3, prompts_per_group=4, prefix_len=32, question_len=8, output_len=5)
    assert len(reqs) == 12 and all(r.prompt_len == 40 and r.max_tokens == 5 for r in reqs)
    by_group = {}
    for r in reqs:
        by_group.setdefault(group_of(r.id), set()).add(tuple(r.prompt[:32]))
    assert all(len(prefixes) == 1 for prefixes in by_group.values())  # one system prompt per group
    assert [group_of(r.id) for r in reqs] != sorted(group_of(r.id) for r in reqs)  # shuffled
    hot = shared_prefix_requests(num_groups=4, prompts_per_group=8, hot_group_fraction=0.75)
    assert sum(group_of(r.id) == 0 for r in hot) == 24
    with pytest.raises(ValueError, match="hot_group_fraction"):
        shared_prefix_requests(hot_group_fraction=1.5)


def test_cache_aware_keeps_prefixes_where_round_robin_thrashes(profile):
    # 12 prefixes of 32 blocks = 384 blocks: 1.5x one engine's 256.
    rr = _run(profile, "round_robin")
    ca = _run(profile, "cache_aware")
    assert rr.prefix_cache_hit_rate <= 0.60
    assert ca.prefix_cache_hit_rate >= 0.85
    assert ca.metrics["median_ttft_ms"] <= 0.7 * rr.metrics["median_ttft_ms"]
    assert rr.metrics["failed"] == ca.metrics["failed"] == 0
    # Without KV pressure round robin keeps its prefixes too: the gap closes.
    rr_big, ca_big = _run(profile, "round_robin", num_blocks=1024), _run(profile, "cache_aware", num_blocks=1024)
    assert ca_big.prefix_cache_hit_rate - rr_big.prefix_cache_hit_rate <= 0.08


def test_cache_aware_at_16_replicas(profile):
    rr = _run(profile, "round_robin", dp=16, rate=32.0)
    ca = _run(profile, "cache_aware", dp=16, rate=32.0)
    assert rr.prefix_cache_hit_rate <= 0.60 and ca.prefix_cache_hit_rate >= 0.85
    assert sum(ca.requests_per_engine) == 192


@pytest.mark.parametrize("rate", [8.0, math.inf])
def test_hot_group_does_not_pile_onto_one_engine(profile, rate):
    ca = _run(profile, "cache_aware", rate=rate, hot_group_fraction=0.75)
    assert all(0.35 <= s <= 0.65 for s in ca.engine_shares), ca.engine_shares
    assert ca.router_decisions["balance"] > 0  # the imbalance fallback did the work


def test_one_engine_simulates_as_simulate(profile):
    requests = assign_arrivals(shared_prefix_requests(num_groups=3, prompts_per_group=6), 4.0, 1.0, 0)
    sched, cache = engine_configs(profile, {"num_blocks": 256, "block_size": 16})
    single = simulate(requests, sched, cache, profile.step_model)
    for policy in ("round_robin", "cache_aware"):
        dp1 = simulate_dp(requests, sched, cache, profile.step_model, 1, RouterConfig(policy=policy))
        assert dp1.metrics == single.metrics
        assert dp1.num_steps == single.num_steps
