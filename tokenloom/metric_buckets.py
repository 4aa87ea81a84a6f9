"""Prometheus histogram buckets by family, as vLLM 0.32's vllm/v1/metrics/buckets.py: every histogram vLLM
exports draws its bucket boundaries from one family, and `--custom-histogram-buckets '{"family": [...]}'`
(`custom_histogram_buckets`, vLLM's ObservabilityConfig field) replaces a family's list for all its histograms.

Pure Python, importing nothing of tokenloom: config.py validates the argument here (vLLM's messages), and the
metrics (tokenloom/engine/metrics.py) build their histograms from `histogram_buckets`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

# vLLM's BucketFamilyKey, in its order. tokenloom exports no histogram of the last two families' (per-request
# preemption counts, KV block residency): a list given for them is accepted, as vLLM accepts it, and unused.
BUCKET_FAMILY_KEYS: tuple[str, ...] = (
    "request_latency", "time_to_first_token", "inter_token_latency", "iteration_tokens", "request_params_n",
    "request_num_preemptions", "request_tokens", "kv_cache_residency",
)

_DEFAULTS: dict[str, tuple[float, ...]] = {
    # Arrival to finish, queue, inference, prefill and decode times.
    "request_latency": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0),
    "time_to_first_token": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                            20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "inter_token_latency": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                            20.0, 40.0, 80.0),
    "iteration_tokens": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "request_params_n": (1, 2, 5, 10, 20),
    "request_num_preemptions": (1, 2, 3, 4, 5, 10, 20),
    "kv_cache_residency": (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
                           600, 1200, 1800),
}


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's request_tokens family: token counts up to max_model_len)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def histogram_buckets(family: str, max_model_len: int | None = None,
                      overrides: Mapping[str, list[float]] | None = None) -> list[float]:
    """The bucket bounds of `family`: the override when one is given (already checked), else vLLM's default
    (request_tokens: 1-2-5 up to `max_model_len`, which it then needs)."""
    if overrides is not None and (custom := overrides.get(family)) is not None:
        return list(custom)
    if family == "request_tokens":
        if max_model_len is None:
            raise ValueError("max_model_len is required for the 'request_tokens' bucket family")
        return build_1_2_5_buckets(max_model_len)
    return list(_DEFAULTS[family])


def check_custom_histogram_buckets(value: Any) -> dict[str, list[float]] | None:
    """vLLM's ObservabilityConfig validators, in its words: a mapping of known families to non-empty lists of
    finite, positive, strictly increasing numbers (booleans refused, not read as 0 / 1). Returns a copy."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"custom_histogram_buckets must be a JSON object mapping a bucket family to a list of "
                         f"bounds, got {type(value).__name__}")
    out: dict[str, list[float]] = {}
    for family, buckets in value.items():
        if family not in BUCKET_FAMILY_KEYS:
            raise ValueError(f"custom_histogram_buckets: unknown bucket family {family!r}; known families: "
                             f"{sorted(BUCKET_FAMILY_KEYS)}")
        if not isinstance(buckets, list | tuple):
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bounds must be a list of numbers, got "
                             f"{type(buckets).__name__}")
        for bound in buckets:
            if isinstance(bound, bool):
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be a number, not a "
                                 "boolean")
            if not isinstance(bound, int | float):
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be a number")
        if not buckets:
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bucket list must not be empty")
        for bound in buckets:
            if not math.isfinite(bound) or bound <= 0:
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be finite and greater "
                                 "than 0")
        if any(a >= b for a, b in pairwise(buckets)):
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bounds {list(buckets)} must be strictly "
                             "increasing")
        out[family] = [float(b) for b in buckets]
    return out
