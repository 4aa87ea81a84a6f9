"""Figures for the opt-in scheduling policies (docs/scheduling_policies.md), on the simulator.

The real scheduler runs over the shipped cost-model profile on a virtual clock, so each figure is
deterministic and takes seconds; the vLLM-identical default is the first row of every table.

    .venv/bin/python benchmarks/scheduling_policies.py --out docs/figures/scheduling_policies.json

1. Starvation: a steady load of decodes that leaves little of the budget, long prompts arriving
   now and then: the long prompts' TTFT (p50/p99) and the decodes' ITL p99, default vs bounded wait.
2. Priority preemption: a full batch of long low-priority requests (max_num_seqs reached), short
   high-priority requests arriving: their TTFT with and without --enable-priority-preemption.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenloom.config import CacheConfig, SchedulerConfig  # noqa: E402
from tokenloom.sim.profile import load_profile  # noqa: E402
from tokenloom.sim.simulate import simulate  # noqa: E402
from tokenloom.workload.datasets import BenchRequest  # noqa: E402

PROFILE = Path(__file__).resolve().parents[1] / "tokenloom/sim/profiles/smollm2-135m-instruct-cpu.json"


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def starvation_workload(seed: int, duration_s: float, decode_rate: float, long_every_s: float,
                        long_len: int) -> list[BenchRequest]:
    """Poisson arrivals of short-prompt, long-output chats (the decode load) plus a long prompt
    (a document to summarise) every `long_every_s` seconds."""
    rng = np.random.default_rng(seed)
    reqs: list[BenchRequest] = []
    t = 0.0
    i = 0
    while t < duration_s:
        t += float(rng.exponential(1.0 / decode_rate))
        reqs.append(BenchRequest(f"chat{i}", [int(x) for x in rng.integers(100, 40000, 32)], 32,
                                 int(rng.integers(100, 200)), True, t))
        i += 1
    for j, at in enumerate(np.arange(long_every_s / 2, duration_s, long_every_s)):
        reqs.append(BenchRequest(f"doc{j}", [int(x) for x in rng.integers(100, 40000, long_len)], long_len, 16,
                                 True, float(at)))
    return sorted(reqs, key=lambda r: r.arrival_s)


def run_starvation(profile: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    reqs = starvation_workload(args.seed, args.duration, args.decode_rate, args.long_every, args.long_len)
    base = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs, max_model_len=8192)
    cache = CacheConfig(block_size=16, num_blocks=args.num_blocks)
    rows = []
    variants = [("default (vLLM)", {})] + [
        (f"bound {ms} ms, chunk {chunk}", {"max_prefill_wait_ms": ms, "min_prefill_chunk": chunk})
        for ms, chunk in args.bounds
    ]
    for name, knobs in variants:
        res = simulate(reqs, replace(base, **knobs), cache, profile.cost_model)
        docs = [r for r in res.records if r.id.startswith("doc") and r.success]
        chats = [r for r in res.records if r.id.startswith("chat") and r.success]
        itl = [x for r in chats for x in r.itl_s]
        rows.append({
            "policy": name,
            "long_prompt_ttft_p50_ms": _pct([r.ttft_s for r in docs], 50),
            "long_prompt_ttft_p99_ms": _pct([r.ttft_s for r in docs], 99),
            "long_prompt_ttft_max_ms": _pct([r.ttft_s for r in docs], 100),
            "decode_itl_p50_ms": _pct(itl, 50),
            "decode_itl_p99_ms": _pct(itl, 99),
            "num_long": len(docs), "num_chats": len(chats),
        })
    return rows


def run_priority(profile: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    reqs = [BenchRequest(f"bulk{i}", [int(x) for x in rng.integers(100, 40000, 256)], 256, 400, True,
                         float(i) * 0.05, priority=10) for i in range(48)]
    reqs += [BenchRequest(f"vip{j}", [int(x) for x in rng.integers(100, 40000, 64)], 64, 32, True,
                          5.0 + 3.0 * j, priority=0) for j in range(10)]
    reqs.sort(key=lambda r: r.arrival_s)
    base = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=8192, policy="priority")
    cache = CacheConfig(block_size=16, num_blocks=20000)
    rows = []
    for name, knobs in [("priority (vLLM)", {}),
                        ("priority + preemption for waiting", {"enable_priority_preemption": True})]:
        res = simulate(reqs, replace(base, **knobs), cache, profile.cost_model)
        vip = [r.ttft_s for r in res.records if r.id.startswith("vip") and r.success]
        bulk = [r.e2e_s for r in res.records if r.id.startswith("bulk") and r.success]
        rows.append({"policy": name, "high_priority_ttft_p50_ms": _pct(vip, 50),
                     "high_priority_ttft_p99_ms": _pct(vip, 99),
                     "low_priority_e2e_p50_ms": _pct(bulk, 50), "num_preemptions": res.num_preemptions})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(PROFILE))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (virtual)")
    p.add_argument("--decode-rate", type=float, default=1.6, help="chat arrivals per second")
    p.add_argument("--long-every", type=float, default=10.0, help="seconds between long prompts")
    p.add_argument("--long-len", type=int, default=4000, help="tokens of each long prompt")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=40000)
    p.add_argument("--bounds", type=lambda s: [tuple(int(x) for x in b.split(":")) for b in s.split(",")],
                   default=[(1000, 64), (1000, 128), (2000, 256)], help="ms:chunk,ms:chunk,...")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    profile = load_profile(args.profile)
    result = {"starvation": run_starvation(profile, args), "priority_preemption": run_priority(profile, args),
              "args": {k: v for k, v in vars(args).items() if k != "bounds"} | {"bounds": args.bounds}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
