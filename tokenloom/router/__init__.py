"""Data-parallel routing: which engine serves a request (pure Python, below the server and the simulator)."""

from tokenloom.router.policies import ROUTING_POLICIES, EngineLoad, NoEngineAvailable, lb_score
from tokenloom.router.prefix_index import EngineBlockLRU, prompt_block_hashes
from tokenloom.router.router import Router, RouterConfig

__all__ = ["ROUTING_POLICIES", "EngineBlockLRU", "EngineLoad", "NoEngineAvailable", "Router", "RouterConfig",
           "lb_score", "prompt_block_hashes"]
