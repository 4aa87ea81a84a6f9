"""What the plots share: reading a step trace, the blocks of a step, colours, titles, the HTML head.

A step trace is the engine's JSONL (tokenloom/engine/trace.py), one object per step. timeline_png.py
(matplotlib) and timeline_svg.py (self-contained HTML) draw the same picture from these helpers;
bench_plots.py uses the palette and the HTML head.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Distinct, print-friendly hues (tab10 without grey, then Dark2/Set1 picks); the light tint of the
# same hue marks prefill so a request keeps one colour across its prefill and decode blocks.
# fmt: off
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
    "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#377eb8", "#4daf4a",
)
# fmt: on
BOUND_COLORS = {"budget": "#ff7f0e", "max_num_seqs": "#9467bd", "kv_blocks": "#d62728", "nothing": "#9e9e9e"}
EXTRA_BOUND_COLORS = ("#8c564b", "#17becf", "#bcbd22", "#e377c2")  # reasons a newer scheduler may add
PREFILL_AGG_COLOR, DECODE_AGG_COLOR = "#9ecae1", "#08519c"
THROUGHPUT_KEYS = ("input tok/s", "output tok/s", "total tok/s")
DEFAULT_MAX_REQUESTS = 40  # beyond this many distinct requests in view, colours stop being readable
MAX_BLOCKS = 20_000  # per-request rectangles; beyond this, aggregate (speed and legibility)


# ---------------------------------------------------------------------------------------------- trace


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_steps(spec: str | None) -> tuple[int | None, int | None]:
    """Parse "A:B" into (A, B), either side optional; a step s is kept when A <= s < B."""
    if not spec:
        return None, None
    lo, sep, hi = spec.partition(":")
    if not sep:
        raise ValueError(f"--steps {spec!r}: expected A:B (either side may be empty)")
    try:
        return (int(lo) if lo.strip() else None), (int(hi) if hi.strip() else None)
    except ValueError:
        raise ValueError(f"--steps {spec!r}: A and B must be step numbers") from None


def select_steps(trace: Sequence[dict], window: tuple[int | None, int | None]) -> list[dict]:
    lo, hi = window
    return [s for s in trace if (lo is None or s["step"] >= lo) and (hi is None or s["step"] < hi)]


@dataclass
class Block:
    req_id: str
    kind: str  # "prefill" | "decode" | "draft"
    tokens: int
    bottom: int


def step_blocks(step: dict) -> list[Block]:
    """The stacked blocks of one column, in the scheduler's order (the `scheduled` dict order).

    Tokens scheduled but listed under neither prefill nor decode are drawn as decode: they extend a
    request that is already generating. Draft tokens under verification (the step's `spec`:
    {request: [drafts, accepted]}) get their own dotted block on top of the request's decode.
    """
    prefill, decode = step.get("prefill") or {}, step.get("decode") or {}
    spec = step.get("spec") or {}
    blocks: list[Block] = []
    bottom = 0
    for rid, n in (step.get("scheduled") or {}).items():
        p = int(prefill.get(rid, 0))
        d = max(int(n) - p, int(decode.get(rid, 0)))
        drafts = min(int(spec[rid][0]), d) if rid in spec else 0
        for kind, k in (("prefill", p), ("decode", d - drafts), ("draft", drafts)):
            if k > 0:
                blocks.append(Block(str(rid), kind, k, bottom))
                bottom += k
    return blocks


def request_colors(trace: Sequence[dict]) -> dict[str, str]:
    """Colour by first appearance in the whole trace, so a window keeps the colours of the full plot."""
    colors: dict[str, str] = {}
    for step in trace:
        for rid in step.get("scheduled") or {}:
            if str(rid) not in colors:
                colors[str(rid)] = PALETTE[len(colors) % len(PALETTE)]
    return colors


def choose_mode(steps: Sequence[dict], mode: str, max_requests: int) -> str:
    if mode in ("requests", "aggregate"):
        return mode
    ids = {rid for s in steps for rid in (s.get("scheduled") or {})}
    n_blocks = sum(len(s.get("scheduled") or {}) for s in steps)
    return "requests" if len(ids) <= max_requests and n_blocks <= MAX_BLOCKS else "aggregate"


def step_totals(step: dict) -> tuple[int, int]:
    blocks = step_blocks(step)
    prefill = sum(b.tokens for b in blocks if b.kind == "prefill")
    return prefill, sum(b.tokens for b in blocks) - prefill


def step_ms(step: dict) -> float:
    return (float(step.get("t_end", 0.0)) - float(step.get("t_start", 0.0))) * 1000.0


def step_intervals(steps: Sequence[dict]) -> list[tuple[float, float, float]] | None:
    """Per step (ms): execute time, host time (schedule + update), and the part of the host time that
    ran while some step executed in the worker thread (what async scheduling hides). None when the
    trace has no execute intervals (older traces, or the simulator)."""
    if not steps or any(s.get("t_exec_start") is None for s in steps):
        return None
    spans = [(float(s["t_exec_start"]), float(s["t_exec_end"])) for s in steps]
    out = []
    for s in steps:
        host = hidden = 0.0
        for a0, a1 in ((s["t_start"], s["t_scheduled"]), (s["t_update"], s["t_end"])):
            host += a1 - a0
            hidden += sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)
        out.append((1e3 * (s["t_exec_end"] - s["t_exec_start"]), 1e3 * host, 1e3 * min(hidden, host)))
    return out


def trace_title(steps: Sequence[dict], title: str | None) -> str:
    if title:
        return title
    if not steps:
        return "empty trace"
    t0, t1 = steps[0].get("t_start", 0.0), steps[-1].get("t_end", 0.0)
    n_pre = sum(len(s.get("preempted") or []) for s in steps)
    return (
        f"steps {steps[0]['step']}–{steps[-1]['step']}  ({len(steps)} steps, t = {t0:.3f}–{t1:.3f} s, "
        f"{n_pre} preemption{'s' * (n_pre != 1)})"
    )


def lighten(hex_color: str, amount: float = 0.55) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * amount)
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def bound_colors(steps: Sequence[dict]) -> dict[str, str]:
    """Colour per `bound_by` value present, known reasons first; unknown ones still get their own."""
    present = {s.get("bound_by") or "nothing" for s in steps}
    out = {b: c for b, c in BOUND_COLORS.items() if b in present}
    for i, b in enumerate(sorted(present - set(BOUND_COLORS))):
        out[b] = EXTRA_BOUND_COLORS[i % len(EXTRA_BOUND_COLORS)]
    return out


# The head of every self-contained HTML page (timelines and benchmark plots).
HTML_HEAD = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
.scroll {{ overflow-x: auto; border: 1px solid #ddd; }}
svg text {{ font: 10px system-ui, sans-serif; }}
rect.blk:hover, rect.blk.hl {{ stroke: #000; stroke-width: 1.5; }}
.legend span {{ display: inline-block; margin-right: 14px; }}
.sw {{ display: inline-block; width: 12px; height: 12px; vertical-align: middle; margin-right: 4px; }}
</style></head><body>
"""
