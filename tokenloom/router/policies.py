"""Routing policies: which of N data-parallel engines gets a new request.

Each policy is a small class with `select(loads, block_hashes) -> engine index` and an optional
`on_routed` hook; the Router (router.py) keeps the state they read. Dead engines are never chosen.

- round_robin: the next live engine in turn.
- least_load: vLLM's DP load balancer (`DPLBAsyncMPClient.get_core_engine_for_request`): score =
  max(in flight, waiting + running) + waiting * 6 * max(0, kv_usage - 0.5); the lowest wins, the
  scan start rotates so ties spread, and the chosen engine's waiting count is bumped locally until
  its next stats report.
- power_of_two: two distinct live engines drawn at random, the one with the lower least_load score.
- cache_aware: SGLang's router (`CacheAwarePolicy::select_worker`) over the engines' block hashes:
  while the engines are imbalanced (max - min in flight > balance_abs_threshold and max >
  min * balance_rel_threshold) the least loaded engine wins; otherwise the engine holding the
  longest prefix wins if that prefix covers more than cache_threshold of the prompt's blocks, else
  the engine whose prefix LRU is smallest (the most room). Either way the prompt's blocks are
  recorded in the chosen engine's LRU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.config import ROUTING_POLICIES
from tokenloom.router.prefix_index import EngineBlockLRU

__all__ = ["ROUTING_POLICIES", "CacheAware", "EngineLoad", "LeastLoad", "NoEngineAvailable", "PowerOfTwo",
           "RoundRobin", "RoutingPolicy", "lb_score"]


@dataclass
class EngineLoad:
    """What the router knows of one engine: its last stats report plus its own in-flight count."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    num_in_flight: int = 0  # routed here by this router and not finished yet (exact)
    alive: bool = True


def _live(loads: Sequence[EngineLoad]) -> list[int]:
    live = [i for i, load in enumerate(loads) if load.alive]
    if not live:
        raise NoEngineAvailable("every data-parallel engine is dead")
    return live


class NoEngineAvailable(RuntimeError):
    pass


def lb_score(load: EngineLoad) -> float:
    """vLLM's DP load-balancing score (one API client: client_count = 1)."""
    score = float(max(load.num_in_flight, load.num_waiting + load.num_running))
    if load.num_waiting:
        # A queue on a KV-bound engine drains slowly: penalise it in proportion to KV pressure.
        score += load.num_waiting * 6.0 * max(0.0, load.kv_cache_usage - 0.5)
    return score


class RoutingPolicy:
    name = ""

    def select(self, loads: Sequence[EngineLoad], block_hashes: Sequence[bytes]) -> int:
        raise NotImplementedError

    def on_routed(self, engine: int, block_hashes: Sequence[bytes]) -> None:
        """The request went to `engine` (called for every policy's choice)."""

    def on_engine_dead(self, engine: int) -> None:
        """The engine is gone: forget what it held."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, loads: Sequence[EngineLoad], block_hashes: Sequence[bytes]) -> int:
        _live(loads)
        n = len(loads)
        for k in range(n):
            i = (self._next + k) % n
            if loads[i].alive:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable: _live found a live engine")


class LeastLoad(RoutingPolicy):
    name = "least_load"

    def __init__(self) -> None:
        self._start = 0

    def select(self, loads: Sequence[EngineLoad], block_hashes: Sequence[bytes]) -> int:
        _live(loads)
        n = len(loads)
        best, best_score = -1, float("inf")
        for k in range(n):
            i = (self._start + k) % n
            if not loads[i].alive:
                continue
            score = lb_score(loads[i])
            if score < best_score:
                best, best_score = i, score
        # Rotate the scan start so equal scores (idle engines) do not always favour the same one.
        self._start = (self._start + 1) % n
        # Bump the local waiting count until the engine's next report (vLLM does the same).
        loads[best].num_waiting += 1
        return best


class PowerOfTwo(RoutingPolicy):
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def select(self, loads: Sequence[EngineLoad], block_hashes: Sequence[bytes]) -> int:
        live = _live(loads)
        if len(live) == 1:
            return live[0]
        a, b = self._rng.sample(live, 2)
        return a if lb_score(loads[a]) <= lb_score(loads[b]) else b


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(
        self,
        num_engines: int,
        lru_blocks: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 4,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees = [EngineBlockLRU(lru_blocks) for _ in range(num_engines)]
        # How each decision was made (figures and tests): "balance", "prefix" or "room".
        self.decisions = {"balance": 0, "prefix": 0, "room": 0}

    def is_imbalanced(self, loads: Sequence[EngineLoad], live: Sequence[int]) -> bool:
        in_flight = [loads[i].num_in_flight for i in live]
        hi, lo = max(in_flight), min(in_flight)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def select(self, loads: Sequence[EngineLoad], block_hashes: Sequence[bytes]) -> int:
        live = _live(loads)
        if self.is_imbalanced(loads, live):
            self.decisions["balance"] += 1
            return min(live, key=lambda i: (loads[i].num_in_flight, i))
        if block_hashes:
            matches = {i: self.trees[i].match(block_hashes) for i in live}
            # The longest match; among equal matches the less loaded engine.
            best = max(live, key=lambda i: (matches[i], -loads[i].num_in_flight, -i))
            if matches[best] / len(block_hashes) > self.cache_threshold:
                self.decisions["prefix"] += 1
                return best
        self.decisions["room"] += 1
        return min(live, key=lambda i: (len(self.trees[i]), loads[i].num_in_flight, i))

    def on_routed(self, engine: int, block_hashes: Sequence[bytes]) -> None:
        self.trees[engine].insert(block_hashes)

    def on_engine_dead(self, engine: int) -> None:
        self.trees[engine].clear()
