"""The workload options `bench serve` and `simulate` share, with vLLM's names and defaults.

Only argparse here: every `tokenloom` command builds its parser, and numpy (datasets.py) should load
only when a workload is actually built (build.py).
"""

from __future__ import annotations

import argparse

DATASET_NAMES = ("random", "sharegpt", "jsonl", "generated-shared-prefix")


def add_dataset_args(g: argparse._ActionsContainer) -> None:
    """The workload options `bench serve` and `simulate` share (vLLM's names and defaults)."""
    g.add_argument("--dataset-name", choices=list(DATASET_NAMES), default="random", help="workload")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: shipped sample) or jsonl")
    g.add_argument("--num-prompts", type=int, default=None, help="default: 100, or every line of a jsonl")
    g.add_argument("--seed", type=int, default=0, help="for lengths, token ids, sampling and arrivals")
    g.add_argument("--random-input-len", type=int, default=1024, help="mean prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="mean max_tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±r)")
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every prompt")
    g.add_argument("--random-vocab-range", default="17:49151", help="LO:HI token ids for random prompts")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="override the answers' lengths")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json for exact ShareGPT lengths")
    # SGLang's generated-shared-prefix (bench_serving.py --gsp-*), scaled down for CPU engines
    # (SGLang's defaults: 64 groups x 16 prompts, 2048 / 128 / 256 tokens).
    g.add_argument("--gsp-num-groups", type=int, default=12, help="generated-shared-prefix: groups (system prompts)")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="generated-shared-prefix: prompts per group")
    g.add_argument("--gsp-system-prompt-len", type=int, default=512, help="generated-shared-prefix: shared tokens")
    g.add_argument("--gsp-question-len", type=int, default=32, help="generated-shared-prefix: own tokens per prompt")
    g.add_argument("--gsp-output-len", type=int, default=16, help="generated-shared-prefix: max_tokens")
    g.add_argument("--gsp-hot-group-fraction", type=float, default=None,
                   help="generated-shared-prefix: one group sends this fraction of the requests (skew)")


def add_arrival_args(g: argparse._ActionsContainer) -> None:
    """When requests arrive: Poisson (or gamma) at a rate, or all at once."""
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests/s; inf = all at once (default; a jsonl keeps its arrival_s unless given)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
