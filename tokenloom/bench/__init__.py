"""Benchmarking: the streaming serving client, engine benchmarks (throughput, sweep), plots.

    from tokenloom.bench import random_requests, run_benchmark
    result = run_benchmark("http://127.0.0.1:8000", "smollm2", random_requests(32, 256, 64), request_rate=4)
    print(result.metrics["p99_ttft_ms"]); result.save("run.json")

client.py (`bench serve`: a workload streamed at an OpenAI endpoint), throughput.py and sweep.py
(`bench throughput | sweep` on the engine in this process, via engine_runs.py), quality.py
(perplexity), plots.py (`plot timeline | bench`; drawing in plot_common.py, timeline_png.py,
timeline_svg.py, bench_plots.py), cli.py. Workloads and metrics live in tokenloom/workload and are
re-exported here. Names resolve lazily: `tokenloom` loads this package for every command, and
aiohttp/matplotlib should only be imported by the commands that use them.

May import: everything below it (config, core, model, engine, workload). Never sim or explore.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchRequest": "tokenloom.workload.datasets",
    "random_requests": "tokenloom.workload.datasets",
    "load_sharegpt": "tokenloom.workload.datasets",
    "load_jsonl": "tokenloom.workload.datasets",
    "write_jsonl": "tokenloom.workload.datasets",
    "arrival_times": "tokenloom.workload.datasets",
    "assign_arrivals": "tokenloom.workload.datasets",
    "RequestRecord": "tokenloom.workload.metrics",
    "compute_metrics": "tokenloom.workload.metrics",
    "format_summary": "tokenloom.workload.metrics",
    "parse_goodput": "tokenloom.workload.metrics",
    "percentile": "tokenloom.workload.metrics",
    "BenchResult": "tokenloom.workload.result",
    "run_benchmark": "client",
    "arun_benchmark": "client",
    "plot_timeline": "plots",
    "plot_bench": "plots",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    target = _EXPORTS[name]
    module = importlib.import_module(target if "." in target else f"{__name__}.{target}")
    return getattr(module, name)
