"""A workload with long prompts among many decodes, for the budget sweep of docs/benchmarks.md.

Short chat-like requests (prompts 32-96 tokens, 96 output tokens) arrive as a Poisson stream; every
`--long-every`-th request is a long prompt (1,536 tokens, 16 outputs) that must be prefilled while
the short ones decode — the case where max_num_batched_tokens trades TTFT against ITL.
Writes the anchors' JSONL format: {"id","arrival_s","prompt_token_ids","max_tokens","ignore_eos"}.

    .venv/bin/python benchmarks/scheduler/mixed_workload.py -o /tmp/mixed.jsonl
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--num", type=int, default=48)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--long-every", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t = 0.0
    with open(args.out, "w") as f:
        for i in range(args.num):
            long = i % args.long_every == args.long_every - 1
            n = args.long_len if long else int(rng.integers(32, 97))
            rec = {
                "id": f"{'long' if long else 'short'}-{i:03d}",
                "arrival_s": round(t, 4),
                "prompt_token_ids": rng.integers(17, 49152, size=n).tolist(),
                "max_tokens": 16 if long else 96,
                "ignore_eos": True,
            }
            f.write(json.dumps(rec) + "\n")
            t += float(rng.exponential(1.0 / args.rate))


if __name__ == "__main__":
    main()
