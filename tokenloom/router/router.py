"""Router: one routing decision per request over N data-parallel engines, and the state behind it.

Pure Python (imports only tokenloom.core), so the API process's DP client and the simulator run the
same code: the DP client feeds it the engines' SchedulerStats as they arrive, the simulator reads
its simulated schedulers. The router also remembers which engine owns each request, so aborts go
to the owner and an engine's death fails exactly its requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenloom.config import ParallelConfig
from tokenloom.core.block_hash import DEFAULT_HASH_ALGO
from tokenloom.core.request import lora_extra_hash_keys
from tokenloom.router.policies import (
    ROUTING_POLICIES,
    CacheAware,
    EngineLoad,
    LeastLoad,
    PowerOfTwo,
    RoundRobin,
    RoutingPolicy,
    lb_score,
)
from tokenloom.router.prefix_index import prompt_block_hashes


@dataclass(frozen=True)
class _LoRAId:
    """What lora_extra_hash_keys reads of a LoRARequest (the router has only the id)."""

    lora_int_id: int


@dataclass
class RouterConfig:
    policy: str = "cache_aware"
    # cache_aware (SGLang's names): a prefix match above this fraction of the prompt's blocks wins.
    cache_threshold: float = 0.3
    # cache_aware: engines count as imbalanced when max - min requests in flight > abs and max > min * rel.
    # SGLang's defaults (64, 1.5) suit many GPUs with hundreds of requests each; 4 keeps a 75 % hot
    # prefix group from piling onto one of a few CPU engines (docs/data_parallel.md). The defaults here
    # are ParallelConfig's (tokenloom/config.py), where the CLI reads them.
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    # cache_aware: blocks remembered per engine. None: the engine's KV pool (it cannot hold more).
    lru_blocks: int | None = None
    seed: int = 0  # power_of_two's draws
    # Prefill/decode hand-off inside the group: engines [0, N) prefill, the rest decode (0: every engine serves).
    num_prefill_engines: int = 0

    @classmethod
    def from_parallel(cls, parallel: ParallelConfig | None) -> RouterConfig:
        """The router's options as the engine's knobs give them (--routing-policy, --router-*)."""
        p = parallel or ParallelConfig()
        return cls(policy=p.routing_policy, cache_threshold=p.router_cache_threshold,
                   balance_abs_threshold=p.router_balance_abs_threshold,
                   balance_rel_threshold=p.router_balance_rel_threshold, lru_blocks=p.router_lru_blocks,
                   num_prefill_engines=p.data_parallel_prefill_engines)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, got {self.policy!r}")
        if self.lru_blocks is not None and self.lru_blocks < 1:
            raise ValueError(f"router lru_blocks must be >= 1, got {self.lru_blocks}")


def make_policy(config: RouterConfig, num_engines: int, engine_num_blocks: int) -> RoutingPolicy:
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_load":
        return LeastLoad()
    if config.policy == "power_of_two":
        return PowerOfTwo(config.seed)
    return CacheAware(num_engines, config.lru_blocks or engine_num_blocks, config.cache_threshold,
                      config.balance_abs_threshold, config.balance_rel_threshold)


class Router:
    """`lora_capacity`: the LoRA adapters an engine keeps loaded (its max_cpu_loras; 0: no LoRA). The
    router remembers, per engine, the adapters it last sent there (LRU, that many), and routes an
    adapter's request to the least loaded engine holding it (Ray Serve's multiplexed-model routing),
    unless that engine is imbalanced against the least loaded one (cache_aware's thresholds): then,
    or when no engine holds it, the policy decides and the chosen engine loads it."""

    def __init__(self, config: RouterConfig, num_engines: int, block_size: int, engine_num_blocks: int,
                 lora_capacity: int = 0, hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        """`hash_algo`: the engines' prefix_caching_hash_algo, so the prefix index keys are their block hashes."""
        if num_engines < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_engines}")
        self.config = config
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self.policy = make_policy(config, num_engines, engine_num_blocks)
        self.owner: dict[str, int] = {}  # request id -> engine, while unfinished
        self.num_routed = [0] * num_engines
        self.lora_capacity = lora_capacity
        self.engine_loras: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]
        self.lora_decisions = {"holder": 0, "policy": 0}  # how adapter requests were routed (tests, figures)

    @property
    def num_engines(self) -> int:
        return len(self.loads)

    def route(self, request_id: str, prompt_token_ids: Sequence[int], lora_int_id: int | None = None,
              engines: range | None = None) -> int:
        """Choose the engine for a new request (run with LoRA adapter `lora_int_id`, if given) among
        `engines` (default: all; prefill/decode hand-off routes each phase among its own) and record it
        as the owner."""
        if request_id in self.owner:
            return self.owner[request_id]
        extra = lora_extra_hash_keys(_LoRAId(lora_int_id)) if lora_int_id is not None else None
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size, extra, self.hash_algo) if isinstance(
            self.policy, CacheAware) else []
        engine = self._lora_holder(lora_int_id) if lora_int_id is not None else None
        if engine is not None and engines is not None and engine not in engines:
            engine = None
        if engine is None:
            loads = self.loads if engines is None else [
                load if i in engines else replace(load, alive=False) for i, load in enumerate(self.loads)]
            engine = self.policy.select(loads, hashes)
            if lora_int_id is not None:
                self.lora_decisions["policy"] += 1
        else:
            self.lora_decisions["holder"] += 1
        self.policy.on_routed(engine, hashes)
        if lora_int_id is not None and self.lora_capacity > 0:
            held = self.engine_loras[engine]
            held[lora_int_id] = None
            held.move_to_end(lora_int_id)
            while len(held) > self.lora_capacity:
                held.popitem(last=False)
        self.owner[request_id] = engine
        self.loads[engine].num_in_flight += 1
        self.num_routed[engine] += 1
        return engine

    def _lora_holder(self, lora_int_id: int) -> int | None:
        """The least loaded live engine that holds the adapter, unless it is imbalanced against the
        least loaded live engine; None: let the policy choose."""
        live = [i for i, load in enumerate(self.loads) if load.alive]
        holders = [i for i in live if lora_int_id in self.engine_loras[i]]
        if not holders:
            return None
        best = min(holders, key=lambda i: lb_score(self.loads[i]))
        hi, lo = self.loads[best].num_in_flight, min(self.loads[i].num_in_flight for i in live)
        cfg = self.config
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            return None
        return best

    def finish(self, request_id: str) -> int | None:
        """The request finished or was aborted; returns its engine (None if unknown)."""
        engine = self.owner.pop(request_id, None)
        if engine is not None:
            self.loads[engine].num_in_flight -= 1
        return engine

    def update_load(self, engine: int, num_waiting: int, num_running: int, kv_cache_usage: float) -> None:
        load = self.loads[engine]
        load.num_waiting, load.num_running, load.kv_cache_usage = num_waiting, num_running, kv_cache_usage

    def mark_dead(self, engine: int) -> list[str]:
        """The engine is gone: never route to it again; returns (and forgets) the requests it owned."""
        self.loads[engine].alive = False
        self.policy.on_engine_dead(engine)
        lost = [rid for rid, e in self.owner.items() if e == engine]
        for rid in lost:
            self.finish(rid)
        return lost

    def requests_of(self, engine: int) -> list[str]:
        return [rid for rid, e in self.owner.items() if e == engine]
