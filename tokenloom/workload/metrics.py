"""Serving metrics from per-request records: pure functions, no I/O, no clocks.

Definitions follow vLLM's `vllm bench serve`, so numbers and key names compare one to one:

- TTFT: send -> first chunk carrying a token.
- E2E (`e2el`): send -> last chunk carrying a token.
- TPOT: (E2E - TTFT) / (output_tokens - 1) per request; requests with one output token have none
  (and count as TPOT 0 for goodput, as vLLM does).
- ITL: every inter-token gap, pooled over requests (see client.py for chunks with several tokens).
- queue time: only when the server reports it (optional; vLLM's server does not).
- duration: first send -> last finish, over all requests, failed ones included.
- throughputs divide completed requests / their input / output tokens by the duration.
- goodput: completed requests meeting every given SLO (ttft, tpot, e2el in ms), per second.

Percentiles interpolate linearly between order statistics (numpy's default method).
All latencies are stored in seconds and reported in ms.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "queue_time")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client measured for one request; times are seconds, offsets from the benchmark start."""

    id: str
    prompt_len: int  # input tokens: usage.prompt_tokens when the server reports it
    max_tokens: int
    arrival_s: float = 0.0  # when the workload wanted it sent
    send_s: float = 0.0  # when it was sent (later than arrival_s under --max-concurrency)
    finish_s: float = 0.0  # when the response ended (stream closed, error, or timeout)
    success: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    num_chunks: int = 0
    queue_time_s: float | None = None
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        return tpot(self)


def tpot(rec: RequestRecord) -> float | None:
    if not rec.success or rec.output_tokens <= 1 or rec.ttft_s is None or rec.e2e_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


# ------------------------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], p: float) -> float:
    """p-th percentile (0..100) by linear interpolation, identical to numpy.percentile's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize(
    values_s: Sequence[float], name: str, percentiles: Iterable[float] = DEFAULT_PERCENTILES
) -> dict[str, float | None]:
    """mean/median/std and percentiles of latencies in seconds, as `{stat}_{name}_ms` keys."""
    percentiles = tuple(percentiles)
    keys = ["mean", "median", "std"] + [percentile_key(p) for p in percentiles]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    out = {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)),  # population, like np.std
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = percentile(ms, p)
    return out


# ----------------------------------------------------------------------------------------------- goodput


def parse_goodput(specs: Iterable[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"goodput SLO {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"goodput SLO {spec!r}: must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not rec.success:
        return False
    observed = {"ttft": rec.ttft_s, "tpot": tpot(rec) or 0.0, "e2el": rec.e2e_s}
    return all(observed[k] is not None and observed[k] * 1000.0 <= v for k, v in slos_ms.items())


# ------------------------------------------------------------------------------------------- aggregates


def benchmark_duration(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.finish_s for r in records) - min(r.send_s for r in records)


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once, from send/finish times (a finish frees before a send at a tie)."""
    events = sorted([(r.send_s, 1) for r in records] + [(r.finish_s, -1) for r in records])
    cur = peak = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def _per_second(x: float, duration: float) -> float | None:
    return x / duration if duration > 0 else None


def compute_metrics(
    records: Sequence[RequestRecord],
    *,
    duration_s: float | None = None,
    slos_ms: dict[str, float] | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, float | int | None]:
    """All aggregates as a flat dict with vLLM's key names (latencies in ms, throughputs per second)."""
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.success]
    duration = benchmark_duration(records) if duration_s is None else duration_s
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, float | int | None] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": _per_second(len(ok), duration),
        "request_goodput": None,
        "input_throughput": _per_second(total_in, duration),
        "output_throughput": _per_second(total_out, duration),
        "total_token_throughput": _per_second(total_in + total_out, duration),
        "max_concurrent_requests": peak_concurrency(records),
    }
    if slos_ms:
        out["request_goodput"] = _per_second(sum(meets_slos(r, slos_ms) for r in ok), duration)
    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for t in (tpot(r) for r in ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2e_s for r in ok if r.e2e_s is not None],
        "queue_time": [r.queue_time_s for r in ok if r.queue_time_s is not None],
    }
    for name in LATENCY_METRICS:
        out.update(summarize(series[name], name, percentiles))
    return out


# ------------------------------------------------------------------------------------------- the table

_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("queue_time", "Queue", "Queue Time (server-reported)"),
)


def _row(label: str, value: float | int | str | None) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {'n/a' if value is None else value:<10}"


def format_summary(metrics: dict, config: dict | None = None) -> str:
    """The summary table, laid out like vLLM's `Serving Benchmark Result`."""
    config = config or {}
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines.append(_row("Successful requests:", metrics["completed"]))
    lines.append(_row("Failed requests:", metrics["failed"]))
    if config.get("max_concurrency"):
        lines.append(_row("Maximum request concurrency:", config["max_concurrency"]))
    if config.get("request_rate") is not None:
        lines.append(_row("Request rate configured (RPS):", config["request_rate"]))
    lines += [
        _row("Benchmark duration (s):", metrics["duration"]),
        _row("Total input tokens:", metrics["total_input_tokens"]),
        _row("Total generated tokens:", metrics["total_output_tokens"]),
        _row("Request throughput (req/s):", metrics["request_throughput"]),
    ]
    if metrics.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", metrics["request_goodput"]))
    lines += [
        _row("Input token throughput (tok/s):", metrics["input_throughput"]),
        _row("Output token throughput (tok/s):", metrics["output_throughput"]),
        _row("Total Token throughput (tok/s):", metrics["total_token_throughput"]),
        _row("Peak concurrent requests:", metrics["max_concurrent_requests"]),
    ]
    for name, short, title in _SECTIONS:
        if metrics.get(f"mean_{name}_ms") is None and name == "queue_time":
            continue  # the server does not report it; say nothing rather than a column of n/a
        lines.append(f"{title:-^50}")
        for key, value in metrics.items():
            stat, _, rest = key.partition("_")
            if rest == f"{name}_ms" and stat not in ("std", "p50"):  # p50 is the median row
                lines.append(_row(f"{stat.capitalize()} {short} (ms):", value))
    lines.append("=" * 50)
    return "\n".join(lines)
