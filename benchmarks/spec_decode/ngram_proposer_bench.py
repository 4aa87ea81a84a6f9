"""Cost of one n-gram proposer step (vLLM's batched KMP, compiled with numba) at many requests.

    .venv/bin/python benchmarks/spec_decode/ngram_proposer_bench.py --requests 128 --context 1024

Each request holds `--context` tokens (random over a small vocabulary, so matches exist), and every
step proposes for all of them, as the runner does after a decode step. Prints the best and median
of `--reps` steps in milliseconds (best: the cost with the least interference on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from tokenloom.spec_decode.ngram_proposer import NgramProposer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    prop = NgramProposer(args.k, args.lookup_min, args.lookup_max, max_model_len=args.context + 64)
    ids = [f"r{i}" for i in range(args.requests)]
    for rid in ids:
        prop.add_request(rid, rng.integers(0, args.vocab, args.context).tolist())
    prop.propose(ids)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        prop.propose(ids)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"requests": args.requests, "context": args.context, "numba": prop.use_numba,
                      "best_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}))


if __name__ == "__main__":
    main()
