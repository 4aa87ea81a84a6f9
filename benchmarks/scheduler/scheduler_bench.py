"""Scheduler micro-benchmark: the cost of schedule() + update_from_output() per step.

With R running requests in decode (one token each per step), a waiting queue of W requests that
cannot be admitted (max_num_seqs is reached), and a pool of B blocks. The cost must grow with R
(the requests scheduled), not with W or B.

    .venv/bin/python benchmarks/scheduler/scheduler_bench.py [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.sampling_params import SamplingParams


def build(num_running: int, num_waiting: int, num_blocks: int) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running,
                        max_model_len=4096),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        clock=time.perf_counter,
    )
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(num_running + num_waiting):
        sched.add_request(Request(f"r{i}", [i % 50_000 + 1] * 32, params, arrival_time=float(i)))
    # Admit the first num_running and run their prefills to completion, so every step is all decodes.
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or len(sched.running) < num_running:
        _step(sched)
    return sched


def _step(sched: Scheduler) -> int:
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    sched.update_from_output(out, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled))
    return len(ids)


def measure(num_running: int, num_waiting: int, num_blocks: int, steps: int, repeats: int) -> float:
    sched = build(num_running, num_waiting, num_blocks)
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            assert _step(sched) == num_running
        per_step.append((time.perf_counter() - t0) / steps)
    return statistics.median(per_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| running | waiting | pool blocks | µs / step | µs / scheduled request |")
    print("|---:|---:|---:|---:|---:|")
    for running in (64, 256, 1024):
        for waiting, blocks in ((0, 20_000), (10_000, 20_000), (0, 200_000), (10_000, 200_000)):
            t = measure(running, waiting, blocks, args.steps, args.repeats)
            print(f"| {running} | {waiting} | {blocks} | {t * 1e6:,.0f} | {t * 1e6 / running:.2f} |", flush=True)


if __name__ == "__main__":
    main()
