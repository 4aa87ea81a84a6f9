"""Real data-parallel engines on the shared-prefix workload: prefix-cache hit rate and TTFT per policy.

Starts `--data-parallel-size` engine processes (the cores split between them) behind AsyncLLM, replays
the shared-prefix workload (tokenloom/bench/shared_prefix.py) at `--request-rate` for each routing
policy in turn (alternating, fresh engines each run so no cache carries over), and prints one line per
run: hit rate (hit / queried prompt tokens over all engines), TTFT p50 / p99, each engine's share.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/data_parallel/dp_prefix.py --policies round_robin,cache_aware
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.clients import make_client
from tokenloom.engine.llm_engine import engine_config_from_kwargs
from tokenloom.sampling_params import SamplingParams
from tokenloom.workload.datasets import assign_arrivals
from tokenloom.workload.metrics import percentile
from tokenloom.workload.shared_prefix import shared_prefix_requests


async def _replay(engine: AsyncLLM, requests) -> list[float]:
    engine.attach()
    t0 = time.monotonic()
    ttfts: list[float] = []

    async def one(r) -> None:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
        sent = time.monotonic()
        stream = engine.open_stream()
        engine.add_request(r.id, r.prompt, SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
                           stream)
        first = None
        async for _ in stream:
            if first is None:
                first = time.monotonic() - sent
        ttfts.append(first)

    await asyncio.gather(*(one(r) for r in requests))
    return ttfts


def run(policy: str, args: argparse.Namespace, requests) -> dict:
    config = engine_config_from_kwargs(model=args.model, num_blocks=args.num_blocks, block_size=16,
                                       data_parallel_size=args.data_parallel_size,
                                       distributed_executor_backend=args.backend, routing_policy=policy)
    client = make_client(config, "warning")
    engine = AsyncLLM.from_client(client, args.model)
    try:
        t = time.monotonic()
        ttfts = asyncio.run(_replay(engine, requests))
        wall = time.monotonic() - t
        stats = engine.scheduler_stats
        routed = getattr(client, "router", None)
        shares = [n / len(requests) for n in routed.num_routed] if routed else [1.0]
    finally:
        engine.shutdown()
    return {"policy": policy, "dp": args.data_parallel_size,
            "hit_rate": round(stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), 3),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
            "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
            "wall_s": round(wall, 1), "shares": [round(s, 2) for s in shares]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data-parallel-size", type=int, default=2)
    ap.add_argument("--backend", default="mp", choices=["mp", "ray"])
    ap.add_argument("--policies", default="round_robin,cache_aware")
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds over the policies")
    ap.add_argument("--num-groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=6)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=176,
                    help="KV blocks per engine (default: the 8 prefixes' 256 blocks are ~1.5x one engine)")
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    requests = shared_prefix_requests(args.num_groups, args.prompts_per_group, args.prefix_len, args.question_len,
                                      args.output_len, seed=args.seed)
    requests = assign_arrivals(requests, args.request_rate, 1.0, args.seed)
    for _ in range(args.repeats):
        for policy in args.policies.split(","):
            print(json.dumps(run(policy, args, requests)), flush=True)


if __name__ == "__main__":
    main()
