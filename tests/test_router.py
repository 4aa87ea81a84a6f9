"""The router's policies on hand-made engine states, and its block hashes against the engine's."""

from __future__ import annotations

import pytest

from tokenloom.core.request import Request
from tokenloom.router import EngineBlockLRU, EngineLoad, NoEngineAvailable, Router, RouterConfig, prompt_block_hashes
from tokenloom.router.policies import CacheAware, LeastLoad, PowerOfTwo, RoundRobin, lb_score


def test_block_hashes_are_the_engines():
    ids = list(range(100, 173))  # 4 full blocks of 16 and a partial one
    req = Request("r", ids, block_size=16)
    assert prompt_block_hashes(ids, 16) == req.block_hashes
    assert len(prompt_block_hashes(ids, 16)) == 4
    assert prompt_block_hashes(ids[:15], 16) == []


def test_round_robin_cycles_and_skips_dead():
    loads = [EngineLoad() for _ in range(3)]
    rr = RoundRobin()
    assert [rr.select(loads, []) for _ in range(4)] == [0, 1, 2, 0]
    loads[2].alive = False
    assert [rr.select(loads, []) for _ in range(3)] == [1, 0, 1]
    for load in loads:
        load.alive = False
    with pytest.raises(NoEngineAvailable):
        rr.select(loads, [])


def test_least_load_scores_like_vllm():
    # vLLM: max(in flight, waiting + running) + waiting * 6 * max(0, kv - 0.5)
    assert lb_score(EngineLoad(num_waiting=2, num_running=3, kv_cache_usage=0.4)) == 5
    assert lb_score(EngineLoad(num_waiting=2, num_running=3, kv_cache_usage=1.0)) == 5 + 2 * 6 * 0.5
    assert lb_score(EngineLoad(num_waiting=0, num_running=1, num_in_flight=4)) == 4
    # Engine 0 has fewer requests but a queue on a full KV cache; engine 1 wins.
    loads = [EngineLoad(num_waiting=2, num_running=2, kv_cache_usage=0.95), EngineLoad(num_running=5)]
    assert LeastLoad().select(loads, []) == 1
    assert loads[1].num_waiting == 1  # the local bump until the next report
    # Low KV pressure: the penalty is off and the smaller queue wins.
    loads = [EngineLoad(num_waiting=2, num_running=2, kv_cache_usage=0.4), EngineLoad(num_running=5)]
    assert LeastLoad().select(loads, []) == 0


def test_least_load_spreads_a_burst_between_stats_reports():
    loads = [EngineLoad() for _ in range(2)]
    ll = LeastLoad()
    picks = [ll.select(loads, []) for _ in range(6)]
    assert sorted(picks) == [0, 0, 0, 1, 1, 1]


def test_power_of_two_takes_the_lighter_of_its_draw():
    loads = [EngineLoad(num_running=9), EngineLoad(num_running=1)]
    p2 = PowerOfTwo(seed=3)
    assert {p2.select(loads, []) for _ in range(10)} == {1}
    loads = [EngineLoad(num_running=9), EngineLoad(num_running=1), EngineLoad(num_running=5)]
    picks = {p2.select(loads, []) for _ in range(50)}
    assert 0 not in picks  # engine 0 loses every draw it is in


def _hashes(group: int, n_blocks: int = 8, block_size: int = 4) -> list[int]:
    return prompt_block_hashes([1000 * group + t for t in range(n_blocks * block_size)], block_size)


def test_cache_aware_follows_the_longest_prefix():
    ca = CacheAware(3, lru_blocks=100)
    a, b = _hashes(1), _hashes(2)
    ca.on_routed(1, a)
    ca.on_routed(2, b[:2])
    loads = [EngineLoad() for _ in range(3)]
    assert ca.select(loads, a) == 1
    # b: engine 2 holds 2 of 8 blocks = 0.25 <= cache_threshold 0.3, so the emptiest LRU wins (engine 0).
    assert ca.select(loads, b) == 0
    ca.on_routed(2, b[:3])  # 3/8 = 0.375 > 0.3
    assert ca.select(loads, b) == 2
    assert ca.decisions == {"balance": 0, "prefix": 2, "room": 1}


def test_cache_aware_falls_back_to_least_in_flight_when_imbalanced():
    ca = CacheAware(2, lru_blocks=100, balance_abs_threshold=4, balance_rel_threshold=1.5)
    a = _hashes(1)
    ca.on_routed(0, a)
    loads = [EngineLoad(num_in_flight=6), EngineLoad(num_in_flight=1)]
    assert ca.select(loads, a) == 1  # 6 - 1 > 4 and 6 > 1.5: balance wins over the prefix
    loads = [EngineLoad(num_in_flight=5), EngineLoad(num_in_flight=1)]
    assert ca.select(loads, a) == 0  # 5 - 1 = 4 is not > 4: the prefix wins
    loads = [EngineLoad(num_in_flight=20), EngineLoad(num_in_flight=14)]
    assert ca.select(loads, a) == 0  # 20 < 14 * 1.5: not imbalanced


def test_cache_aware_skips_dead_engines():
    ca = CacheAware(2, lru_blocks=100)
    a = _hashes(1)
    ca.on_routed(0, a)
    loads = [EngineLoad(alive=False), EngineLoad()]
    assert ca.select(loads, a) == 1


def test_lru_evicts_deepest_blocks_first_and_bounds_size():
    lru = EngineBlockLRU(capacity=6)
    a, b = _hashes(1, 4), _hashes(2, 4)
    lru.insert(a)
    assert lru.match(a) == 4
    lru.insert(b)  # 8 blocks > 6: a's two deepest go, a's root stays
    assert len(lru) == 6
    assert lru.match(a) == 2
    assert lru.match(b) == 4


def test_router_tracks_owners_and_in_flight():
    router = Router(RouterConfig(policy="round_robin"), 2, block_size=4, engine_num_blocks=64)
    assert router.route("x", [1] * 8) == 0
    assert router.route("y", [1] * 8) == 1
    assert router.route("x", [1] * 8) == 0  # known id: same owner
    assert [load.num_in_flight for load in router.loads] == [1, 1]
    assert router.finish("x") == 0
    assert router.finish("x") is None
    assert router.mark_dead(1) == ["y"]
    assert router.route("z", [1] * 8) == 0
    with pytest.raises(ValueError, match="routing_policy"):
        RouterConfig(policy="random")


def test_router_cache_aware_sends_a_group_to_one_engine():
    router = Router(RouterConfig(policy="cache_aware"), 2, block_size=4, engine_num_blocks=64)
    prefix_a, prefix_b = [5] * 32, [6] * 32
    first_a = router.route("a0", prefix_a + [1, 2, 3])
    first_b = router.route("b0", prefix_b + [1, 2, 3])
    assert first_a != first_b  # the second group goes to the engine with room
    for i in range(1, 4):
        assert router.route(f"a{i}", prefix_a + [i] * 5) == first_a
        assert router.route(f"b{i}", prefix_b + [i] * 5) == first_b
