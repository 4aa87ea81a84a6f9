"""Benchmarking: workloads, a streaming serving client, metrics, and plots.

    from tokenloom.bench import random_requests, run_benchmark
    result = run_benchmark("http://127.0.0.1:8000", "smollm2", random_requests(32, 256, 64), request_rate=4)
    print(result.metrics["p99_ttft_ms"]); result.save("run.json")

Names resolve lazily: `tokenloom` loads this package for every command, and aiohttp/matplotlib
should only be imported by the commands that use them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchRequest": "workloads",
    "random_requests": "workloads",
    "load_sharegpt": "workloads",
    "load_jsonl": "workloads",
    "write_jsonl": "workloads",
    "arrival_times": "workloads",
    "assign_arrivals": "workloads",
    "RequestRecord": "metrics",
    "compute_metrics": "metrics",
    "format_summary": "metrics",
    "parse_goodput": "metrics",
    "percentile": "metrics",
    "BenchResult": "client",
    "run_benchmark": "client",
    "arun_benchmark": "client",
    "plot_timeline": "plots",
    "plot_bench": "plots",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
