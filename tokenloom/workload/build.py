"""Building a workload from its description: the one place the dataset options turn into requests.

`build_workload` is what `tokenloom bench serve` and `tokenloom simulate` send (vLLM's
`--dataset-name random|sharegpt|jsonl` and `--random-*` options, as explicit parameters);
`engine_workload` is what `bench throughput` and `bench sweep` run on the engine in this process.
"""

from __future__ import annotations

import math

from tokenloom.workload.datasets import (
    DEFAULT_VOCAB_RANGE,
    BenchRequest,
    Tokenize,
    assign_arrivals,
    load_jsonl,
    load_sharegpt,
    random_requests,
)
from tokenloom.workload.options import DATASET_NAMES
from tokenloom.workload.shared_prefix import shared_prefix_requests


def parse_vocab_range(spec: str) -> tuple[int, int]:
    """'17:49151' → (17, 49151)."""
    lo, sep, hi = spec.partition(":")
    if not sep:
        raise ValueError(f"--random-vocab-range {spec!r}: expected LO:HI")
    return int(lo), int(hi)


def load_tokenizer(path: str | None) -> Tokenize | None:
    """A tokenizer.json as a text → token ids function (exact ShareGPT lengths), or None."""
    if not path:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the `tokenizers` package") from None
    tok = Tokenizer.from_file(path)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def build_workload(
    dataset_name: str = "random",
    *,
    dataset_path: str | None = None,
    num_prompts: int | None = None,
    seed: int = 0,
    random_input_len: int = 1024,
    random_output_len: int = 128,
    random_range_ratio: float = 0.0,
    random_prefix_len: int = 0,
    random_vocab_range: tuple[int, int] = DEFAULT_VOCAB_RANGE,
    random_prompt_format: str = "token-ids",
    sharegpt_output_len: int | None = None,
    tokenizer: str | None = None,
    ignore_eos: bool = False,
    gsp_num_groups: int = 12,
    gsp_prompts_per_group: int = 16,
    gsp_system_prompt_len: int = 512,
    gsp_question_len: int = 32,
    gsp_output_len: int = 16,
    gsp_hot_group_fraction: float | None = None,
) -> list[BenchRequest]:
    """The requests of one workload, without arrival times (`assign_arrivals` adds them).

    num_prompts None: 100, or every line of a jsonl. ignore_eos applies to ShareGPT; random prompts
    always ignore EOS (they make no sense to the model, so EOS would stop them arbitrarily) and a jsonl
    carries its own.
    """
    if dataset_name not in DATASET_NAMES:
        raise ValueError(f"dataset_name must be one of {', '.join(DATASET_NAMES)}, got {dataset_name!r}")
    if dataset_name == "jsonl":
        if not dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        return load_jsonl(dataset_path, num_prompts)
    if dataset_name == "generated-shared-prefix":  # groups x prompts; num_prompts does not apply
        return shared_prefix_requests(gsp_num_groups, gsp_prompts_per_group, gsp_system_prompt_len, gsp_question_len,
                                      gsp_output_len, gsp_hot_group_fraction, seed=seed,
                                      vocab_range=random_vocab_range)  # fmt: skip
    if dataset_name == "sharegpt":
        return load_sharegpt(dataset_path, num_prompts or 100, seed=seed, output_len=sharegpt_output_len,
                             tokenize=load_tokenizer(tokenizer), ignore_eos=ignore_eos)  # fmt: skip
    return random_requests(
        num_prompts or 100, random_input_len, random_output_len, random_range_ratio, prefix_len=random_prefix_len,
        seed=seed, vocab_range=random_vocab_range, as_text=random_prompt_format == "text", ignore_eos=True,
    )  # fmt: skip


def engine_workload(
    dataset_path: str | None = None,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    request_rate: float | None = math.inf,
    fixed_output_len: bool = False,
) -> list[BenchRequest]:
    """The workload `bench throughput` / `bench sweep` run on the engine: a JSONL file (all of it, its
    own arrivals), or random token prompts; every request ignores EOS so output lengths are exact.

    request_rate: Poisson arrivals for random prompts; None puts every request at t=0 (offline).
    fixed_output_len: every random request generates exactly `output_len` (only prompts vary).
    """
    if dataset_path:
        reqs = load_jsonl(dataset_path)
    else:
        reqs = random_requests(num_prompts, input_len, output_len, range_ratio, seed=seed)
        if fixed_output_len:
            for r in reqs:
                r.max_tokens = output_len
        if request_rate is not None:
            reqs = assign_arrivals(reqs, request_rate, 1.0, seed)
    for r in reqs:
        if request_rate is None:
            r.arrival_s = 0.0
        r.ignore_eos = True
    return reqs


def workload_from_args(args: object, **override: object) -> list[BenchRequest]:
    """`build_workload` from the parsed options of `bench serve` or `simulate` (the same vLLM names);
    `override` replaces what a command fixes or resolves itself (the simulator always ignores EOS)."""
    params: dict = {
        "dataset_name": args.dataset_name, "dataset_path": args.dataset_path, "num_prompts": args.num_prompts,
        "seed": args.seed, "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "random_prefix_len": args.random_prefix_len,
        "random_vocab_range": parse_vocab_range(args.random_vocab_range),
        "random_prompt_format": getattr(args, "random_prompt_format", "token-ids"),
        "sharegpt_output_len": args.sharegpt_output_len, "tokenizer": args.tokenizer,
        "ignore_eos": getattr(args, "ignore_eos", False),
    }  # fmt: skip
    for name in ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
                 "gsp_output_len", "gsp_hot_group_fraction"):
        if hasattr(args, name):
            params[name] = getattr(args, name)
    params.update(override)
    return build_workload(params.pop("dataset_name"), **params)
