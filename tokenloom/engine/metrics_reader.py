"""vLLM's metrics reader (vllm/v1/metrics/reader.py, 0.32): `LLM.get_metrics()`'s types, same names and fields.

vLLM reads the process-wide Prometheus REGISTRY; tokenloom gives each LLMEngine a registry of its own (two
LLMs in one process count apart), so `get_metrics_snapshot` takes the registry to read. As vLLM's, it returns
the `vllm:` figures only, counters without Prometheus' `_total` suffix, and the per-position accepted-token
counters of speculative decoding as one Vector.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

PREFIX = "vllm:"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """A figure and its labels; one name may come with several label sets."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters: only vllm:spec_decode_num_accepted_tokens_per_pos, by position."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: upper limit (the `le` label, '+Inf' always there) -> cumulative count; `count`
    equals the '+Inf' bucket, `sum` is the total of the observed values."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """The `vllm:` figures of `registry` now, as vLLM's reader types."""
    collected: list[Metric] = []
    for metric in registry.collect():
        if not metric.name.startswith(PREFIX):
            continue
        if metric.type == "gauge":
            collected += [Gauge(metric.name, s.labels, s.value) for s in _samples(metric.samples, metric.name)]
        elif metric.type == "counter":
            samples = _samples(metric.samples, metric.name + "_total")
            if metric.name == _PER_POS:
                collected += _per_position(samples)
            else:
                collected += [Counter(metric.name, s.labels, int(s.value)) for s in samples]
        elif metric.type == "histogram":
            collected += _histograms(metric.name, metric.samples)
        else:  # vLLM's reader asserts as well: a new kind of figure must be read deliberately
            raise AssertionError(f"Unknown metric type {metric.type}")
    return collected


def _samples(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def _without(labels: dict[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != key}


def _per_position(samples: list[Sample]) -> list[Metric]:
    """One Vector per label set (less `position`), its values in position order."""
    by_labels: dict[frozenset[tuple[str, str]], dict[int, int]] = {}
    for s in samples:
        key = frozenset(_without(s.labels, "position").items())
        by_labels.setdefault(key, {})[int(s.labels["position"])] = int(s.value)
    return [Vector(_PER_POS, dict(key), [values[i] for i in sorted(values)]) for key, values in by_labels.items()]


def _histograms(name: str, samples: list[Sample]) -> list[Metric]:
    """One Histogram per label set (less `le`), from its _bucket, _count and _sum samples."""
    buckets: dict[frozenset[tuple[str, str]], dict[str, int]] = {}
    for s in _samples(samples, name + "_bucket"):
        buckets.setdefault(frozenset(_without(s.labels, "le").items()), {})[s.labels["le"]] = int(s.value)
    counts = {frozenset(s.labels.items()): int(s.value) for s in _samples(samples, name + "_count")}
    sums = {frozenset(s.labels.items()): s.value for s in _samples(samples, name + "_sum")}
    return [Histogram(name, dict(key), counts.get(key, 0), sums.get(key, 0.0), by_le)
            for key, by_le in buckets.items()]
