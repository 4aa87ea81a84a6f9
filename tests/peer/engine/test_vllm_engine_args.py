# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/engine/test_engine_args.py: the cases on the prefix-caching flags and
# custom_histogram_buckets, unchanged but for the plumbing: EngineArgs is tokenloom's (tokenloom/engine/args.py),
# FlexibleArgumentParser is argparse's ArgumentParser, `_xxhash` is the xxhash module or None, and
# create_engine_config's result is read through vLLM's names (cache_config: tokenloom's EngineConfig.cache;
# observability_config: its EngineConfig.observability_config). Not vendored (docs/vllm_peer.md, "Engine
# level"): test_mm_prefix_lm_raises_batched_tokens_floor (multimodal prefix-LM models, mocked) and the five
# data-parallel rank-inference cases (vLLM's multi-node hybrid / external load balancing on mocked MoE configs;
# tokenloom's data parallelism is one node's engines under one router).
from argparse import ArgumentError
from argparse import ArgumentParser as FlexibleArgumentParser
from types import SimpleNamespace

import pytest

from tokenloom.config import ConfigError
from tokenloom.engine.args import EngineArgs as _TLEngineArgs

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover
    _xxhash = None


class EngineArgs(_TLEngineArgs):
    """tokenloom's EngineArgs whose create_engine_config answers under vLLM's VllmConfig names."""

    def create_engine_config(self):  # type: ignore[override]
        config = super().create_engine_config()
        return SimpleNamespace(cache_config=config.cache, scheduler_config=config.scheduler,
                               observability_config=config.observability_config)


@pytest.mark.xfail(strict=True, raises=ConfigError, reason=(
    "prefix_cache_retention_interval: tokenloom keeps no periodic sliding-window / Mamba prefix-cache checkpoints, "
    "so only 0 (vLLM's default) is accepted and 64 is refused by name (every assertion before it passes)"))
def test_prefix_caching_from_cli():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.enable_prefix_caching, (
        "V1 turns on prefix caching by default."
    )
    assert vllm_config.cache_config.prefix_cache_retention_interval == 0

    # Turn it off possible with flag.
    args = parser.parse_args(["--no-enable-prefix-caching"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert not vllm_config.cache_config.enable_prefix_caching

    # Turn it on with flag.
    args = parser.parse_args(["--enable-prefix-caching"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.enable_prefix_caching

    # default hash algorithm is "builtin"
    assert vllm_config.cache_config.prefix_caching_hash_algo == "sha256"

    # set hash algorithm to sha256_cbor
    args = parser.parse_args(["--prefix-caching-hash-algo", "sha256_cbor"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.prefix_caching_hash_algo == "sha256_cbor"

    # set hash algorithm to sha256
    args = parser.parse_args(["--prefix-caching-hash-algo", "sha256"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.prefix_caching_hash_algo == "sha256"

    # an invalid hash algorithm raises an error
    parser.exit_on_error = False
    with pytest.raises(ArgumentError):
        args = parser.parse_args(["--prefix-caching-hash-algo", "invalid"])

    args = parser.parse_args(["--prefix-cache-retention-interval", "64"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.prefix_cache_retention_interval == 64


@pytest.mark.skipif(_xxhash is None, reason="xxhash not installed")
def test_prefix_caching_xxhash_from_cli():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())

    # set hash algorithm to xxhash (pickle)
    args = parser.parse_args(["--prefix-caching-hash-algo", "xxhash"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.prefix_caching_hash_algo == "xxhash"

    # set hash algorithm to xxhash_cbor
    args = parser.parse_args(["--prefix-caching-hash-algo", "xxhash_cbor"])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.cache_config.prefix_caching_hash_algo == "xxhash_cbor"


def test_custom_histogram_buckets_from_cli():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())

    # Unset: byte-identical default behavior.
    args = parser.parse_args([])
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.observability_config.custom_histogram_buckets is None

    # A JSON mapping round-trips into the config verbatim.
    args = parser.parse_args(
        [
            "--custom-histogram-buckets",
            '{"request_latency": [0.01, 0.05, 0.1, 0.5]}',
        ]
    )
    vllm_config = EngineArgs.from_cli_args(args=args).create_engine_config()
    assert vllm_config.observability_config.custom_histogram_buckets == {
        "request_latency": [0.01, 0.05, 0.1, 0.5]
    }

    # Malformed JSON is rejected at argument-parsing time.
    parser.exit_on_error = False
    with pytest.raises(ArgumentError):
        parser.parse_args(["--custom-histogram-buckets", "{not json"])

    # An unknown family key parses as JSON but fails config validation.
    args = parser.parse_args(["--custom-histogram-buckets", '{"bogus": [1.0, 2.0]}'])
    with pytest.raises(ValueError, match="unknown bucket family"):
        EngineArgs.from_cli_args(args=args).create_engine_config()
