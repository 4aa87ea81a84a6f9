"""Engine options for the command line, with vLLM's names, shared by generate, chat, serve and bench."""

from __future__ import annotations

import argparse
import re

from tokenloom.config import QUANTIZATION_METHODS
from tokenloom.engine.llm_engine import engine_config_from_kwargs

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1073741824' → bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 512MiB or a number of bytes)")
    unit = (m.group(2) or "").upper().rstrip("B")
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown size unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    if with_model:
        parser.add_argument("model", nargs="?", default=None,
                            help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the CPU has AMX / AVX-512-BF16 (or on CUDA), else float32")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                   help="int8: W8A8 decoder layers (int8 weights per channel, int8 activations per token; "
                        "oneDNN VNNI GEMMs, ~1.4x the bf16 throughput on CPU; the LM head stays in --dtype)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (default: 2GiB on CPU, 90%% of free memory on CUDA)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace-steps", default=None, metavar="FILE", help="write one JSON line per engine step")
    g.add_argument("--speculative-config", "-sc", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s option: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (docs/speculative.md)')
    s = parser.add_argument_group("scheduler")
    s.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (2048)")
    s.add_argument("--max-num-seqs", type=int, default=None, help="most running requests (128)")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    s.add_argument("--long-prefill-token-threshold", type=int, default=None)
    s.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=None)
    s.add_argument("--watermark", type=float, default=None)
    s.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=None)
    s.add_argument("--batching", choices=["continuous", "static", "request"], default=None,
                   help="batching granularity (continuous = iteration-level, vLLM's)")
    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=None)
    c.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (overrides --kv-cache-memory)")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    keys = [
        "dtype", "device", "quantization", "kv_cache_memory", "max_model_len", "seed", "trace_steps",
        "speculative_config",
        "max_num_batched_tokens",
        "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold", "scheduling_policy", "watermark",
        "scheduler_reserve_full_isl", "batching", "block_size", "num_blocks", "enable_prefix_caching",
    ]
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def engine_config_from_args(args: argparse.Namespace):
    return engine_config_from_kwargs(model=getattr(args, "model", None), **engine_kwargs_from_args(args))
