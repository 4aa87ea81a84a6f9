"""Pictures of a schedule (engine step traces) and of benchmark results.

Timeline (`plot_timeline`): continuous batching step by step. One column per step whose height is the
token budget; inside it a stacked block per request sized by its scheduled tokens (prefill hatched and
light, decode solid, one colour per request for the whole trace), red triangles above a column for
preemptions. Below, on the same step axis: KV blocks used/cached against the pool size, running and
waiting queue lengths, and the step's duration coloured by what bound it. Long traces: pick a window
with `steps=(a, b)`; when the window holds too many requests or blocks to tell apart, the columns
fall back to two aggregate stacks (all prefill, all decode tokens).

Bench (`plot_bench`): latency CDFs (TTFT, ITL, E2E) with one line per result file, and throughput
bars. Result files are ours or vLLM's (`--result-file` / `--save-result` JSON).

Both write PNG (matplotlib, Agg canvas, no pyplot state) or one self-contained HTML file (inline SVG,
data embedded, no network). This module is the front door; the drawing lives in plot_common.py
(trace reading, blocks, colours), timeline_png.py, timeline_svg.py and bench_plots.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from tokenloom.bench.bench_plots import bench_figure, bench_html, load_bench_result
from tokenloom.bench.plot_common import choose_mode, load_trace, parse_steps, select_steps, step_blocks
from tokenloom.bench.timeline_png import timeline_figure
from tokenloom.bench.timeline_svg import timeline_html

# The front door's API (the CLI and tests use these names from here).
__all__ = ["bench_figure", "bench_html", "choose_mode", "load_bench_result", "load_trace", "parse_steps",
           "plot_bench", "plot_timeline", "select_steps", "step_blocks", "timeline_figure", "timeline_html"]

# ----------------------------------------------------------------------------------------------- files


def _write(out: str | Path, fig_or_html: Figure | str) -> Path:
    out = Path(out)
    if isinstance(fig_or_html, str):
        out.write_text(fig_or_html, encoding="utf-8")
    else:
        fig_or_html.savefig(out)
    return out


def _check_suffix(out: str | Path) -> str:
    suffix = Path(out).suffix.lower()
    if suffix not in (".png", ".html", ".htm", ".svg", ".pdf"):
        raise ValueError(f"{out}: output must end in .png or .html (or .svg/.pdf)")
    return suffix


def plot_timeline(trace: str | Path | Sequence[dict], out: str | Path, **kwargs: Any) -> Path:
    """Draw a step trace (a JSONL path or the parsed steps) to PNG/SVG/PDF or self-contained HTML."""
    steps = load_trace(trace) if isinstance(trace, str | Path) else list(trace)
    if _check_suffix(out) in (".html", ".htm"):
        return _write(out, timeline_html(steps, **kwargs))
    return _write(out, timeline_figure(steps, **kwargs))


def plot_bench(
    results: Sequence[str | Path],
    out: str | Path,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Compare result files: latency CDFs and throughput bars."""
    if labels and len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} result files")
    series = [load_bench_result(p, labels[i] if labels else None) for i, p in enumerate(results)]
    if _check_suffix(out) in (".html", ".htm"):
        return _write(out, bench_html(series, title))
    return _write(out, bench_figure(series, title))
