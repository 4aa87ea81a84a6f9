"""`--sweep KNOB=v1,v2,...`: one run per value of one knob (`simulate`, `bench sweep`), summarised in a table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloom.config import engine_args

# Engine keyword names (vLLM's, as in `tokenloom serve`) of every knob the simulator models, plus the
# workload's request rate; `bench sweep` checks its own subset (no model reload).
KNOBS: dict[str, Callable[[str], Any]] = {a.name: a.parse for a in engine_args() if a.simulated}
KNOBS["request_rate"] = float


@dataclass
class Sweep:
    knob: str
    values: list[Any]
    labels: list[str]  # the values as typed, for the table and file names


def parse_sweep(spec: str) -> Sweep:
    name, sep, values = spec.partition("=")
    knob = name.strip().lstrip("-").replace("-", "_")
    if not sep or not values.strip():
        raise ValueError(f"--sweep {spec!r}: expected KNOB=v1,v2,...")
    if knob not in KNOBS:
        raise ValueError(f"--sweep: unknown knob {name!r}; one of: {', '.join(k.replace('_', '-') for k in KNOBS)}")
    labels = [v.strip() for v in values.split(",") if v.strip()]
    try:
        parsed = [KNOBS[knob](v) for v in labels]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--sweep {spec!r}: {exc}") from None
    return Sweep(knob, parsed, labels)


def suffixed(path: str | None, knob: str, label: str) -> str | None:
    """out.json -> out.max_num_seqs=64.json: one file per swept value."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{knob}={label}{p.suffix}"))


_COLUMNS = [
    ("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("ITL p50", "median_itl_ms"),
    ("ITL p99", "p99_itl_ms"), ("E2E p50", "median_e2el_ms"), ("E2E p99", "p99_e2el_ms"),
    ("out tok/s", "output_throughput"),
]  # fmt: skip


def format_table(knob: str, rows: list[tuple[str, dict[str, Any], int, int]]) -> str:
    """rows: (value label, metrics, preemptions, steps). Latencies in ms."""
    head = [knob] + [c for c, _ in _COLUMNS] + ["preempt", "steps", "failed"]
    body = []
    for label, metrics, preemptions, steps in rows:
        cells = [label]
        for _, key in _COLUMNS:
            v = metrics.get(key)
            cells.append("n/a" if v is None else f"{v:.1f}")
        cells += [str(preemptions), str(steps), str(metrics.get("failed", 0))]
        body.append(cells)
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
    return "\n".join([fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in body])
