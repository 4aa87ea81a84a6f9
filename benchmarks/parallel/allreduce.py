"""All-reduce cost between tensor-parallel ranks on one node: gloo vs the shared-memory path.

Starts `--ranks` processes that form one TP group (tokenloom/distributed: gloo for set-up, the
shared-memory all-reduce attached), then for each tensor size times both paths, alternating
gloo / shm rounds (A/B in one run, so machine load hits both alike), and prints the median
microseconds per all-reduce per path and size. The sizes are a decode row, a small batch and a
prefill chunk of the default model (hidden 576, float32) and one of a 70B model (hidden 8192).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/parallel/allreduce.py --ranks 2 \
        --json docs/figures/allreduce_gloo_vs_shm.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# (label, rows, hidden): floats per all-reduce = rows x hidden
SIZES = [("decode 1 row, H=576", 1, 576), ("decode 16 rows, H=576", 16, 576), ("prefill 512 rows, H=576", 512, 576),
         ("decode 1 row, H=8192", 1, 8192), ("decode 16 rows, H=8192", 16, 8192)]


def _rank(rank: int, world: int, port: int, rounds: int, iters: int, out_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from tokenloom.distributed import init_distributed_environment, initialize_model_parallel
    from tokenloom.distributed.parallel_state import get_tp_group

    init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(world, 1)
    group = get_tp_group()
    assert group.shm is not None, "the shared-memory path did not attach"
    results = {}
    warm = torch.randn(SIZES[-1][1], SIZES[-1][2])
    for _ in range(20):  # first touches of the shared pages and gloo's buffers stay out of the figures
        group.shm.all_reduce(warm)
        dist.all_reduce(warm, group=group.device_group)
    for label, rows, hidden in SIZES:
        x = torch.randn(rows, hidden)
        times: dict[str, list[float]] = {"gloo": [], "shm": []}
        for _ in range(rounds):
            for path in ("gloo", "shm"):
                group.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    if path == "shm":
                        group.shm.all_reduce(x)
                    else:
                        dist.all_reduce(x, group=group.device_group)
                times[path].append((time.perf_counter() - t0) / iters * 1e6)
                x.div_(world)  # keep the values bounded
        results[label] = {"bytes": rows * hidden * 4, **{p: statistics.median(t) for p, t in times.items()},
                          **{f"{p}_best": min(t) for p, t in times.items()}}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="alternating gloo/shm rounds per size")
    parser.add_argument("--iters", type=int, default=200, help="all-reduces per round")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = f"/tmp/tokenloom-allreduce-{os.getpid()}.json"
    mp.spawn(_rank, args=(args.ranks, port, args.rounds, args.iters, tmp), nprocs=args.ranks)
    results = json.loads(Path(tmp).read_text())
    os.unlink(tmp)
    print(f"{'tensor':28s} {'bytes':>9s} {'gloo us':>9s} {'shm us':>9s} {'gloo/shm':>9s}   best gloo / shm us")
    for label, r in results.items():
        print(f"{label:28s} {r['bytes']:9d} {r['gloo']:9.1f} {r['shm']:9.1f} {r['gloo'] / r['shm']:9.2f}   "
              f"{r['gloo_best']:.1f} / {r['shm_best']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "rounds": args.rounds, "iters": args.iters,
                                               "cpus": len(os.sched_getaffinity(0)), "results": results}, indent=1))


if __name__ == "__main__":
    main()
