"""Benchmark result plots: latency CDFs (TTFT, ITL, E2E), one line per result file, and throughput
bars, as a matplotlib figure or a self-contained HTML page. Result files are ours or vLLM's.
"""

from __future__ import annotations

import html
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from tokenloom.bench.plot_common import HTML_HEAD, PALETTE, THROUGHPUT_KEYS

# ----------------------------------------------------------------------------------------- bench results


@dataclass
class BenchSeries:
    label: str
    ttfts_s: list[float]
    itls_s: list[float]
    e2els_s: list[float]
    throughput: dict[str, float]


def load_bench_result(path: str | Path, label: str | None = None) -> BenchSeries:
    """Latency samples and throughputs from our result JSON or vLLM's."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    ttfts = [float(x) for x in data.get("ttfts") or [] if x is not None]
    itls = [float(g) for per_req in data.get("itls") or [] for g in (per_req or [])]
    e2els = [float(x) for x in data.get("e2els") or [] if x is not None]
    if not e2els and data.get("requests"):
        e2els = [
            float(r["e2e_s"]) for r in data["requests"] if r.get("success") and r.get("e2e_s") is not None
        ]
    out_tp = float(data.get("output_throughput") or 0.0)
    total_tp = float(data.get("total_token_throughput") or 0.0)
    throughput = {
        "input tok/s": float(data.get("input_throughput") or max(total_tp - out_tp, 0.0)),
        "output tok/s": out_tp,
        "total tok/s": total_tp,
    }
    return BenchSeries(label or Path(path).stem, ttfts, itls, e2els, throughput)


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(v * 1000.0 for v in values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def bench_figure(series: Sequence[BenchSeries], title: str | None = None) -> Figure:
    fig = Figure(figsize=(15, 9), dpi=100, layout="constrained")
    axes = fig.subplots(2, 2)
    panels = (("TTFT", "ttfts_s"), ("ITL", "itls_s"), ("E2E latency", "e2els_s"))
    for ax, (name, attr) in zip(axes.flat, panels):
        for i, s in enumerate(series):
            values = getattr(s, attr)
            if values:
                xs, ys = _cdf(values)
                ax.step(
                    xs,
                    ys,
                    where="post",
                    color=PALETTE[i % len(PALETTE)],
                    label=f"{s.label} (n={len(values)})",
                )
        ax.axhline(0.5, color="#bbbbbb", lw=0.8, ls=":")
        ax.axhline(0.99, color="#bbbbbb", lw=0.8, ls=":")
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(color="#eeeeee")
        if ax.has_data():
            ax.legend(fontsize=8, loc="lower right")
    ax = axes.flat[3]
    metrics = THROUGHPUT_KEYS
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        xs = [m + (i - (len(series) - 1) / 2) * width for m in range(len(metrics))]
        bars = ax.bar(
            xs,
            [s.throughput[m] for m in metrics],
            width=width,
            label=s.label,
            color=PALETTE[i % len(PALETTE)],
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(metrics)), metrics)
    ax.set_axisbelow(True)
    ax.set_title("throughput")
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", color="#eeeeee")
    fig.suptitle(title or "benchmark comparison: " + " vs ".join(s.label for s in series))
    return fig


def _figure_svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.find("<svg") :]  # drop the XML prolog and doctype: the svg sits inline in HTML


def bench_html(series: Sequence[BenchSeries], title: str | None = None) -> str:
    heading = html.escape(title or "benchmark comparison")
    rows = []
    for s in series:
        cells = [html.escape(s.label)] + [f"{s.throughput[m]:.1f}" for m in THROUGHPUT_KEYS]
        for values in (s.ttfts_s, s.itls_s, s.e2els_s):
            ms = sorted(v * 1000 for v in values)
            cells += [f"{_pct(ms, 50):.1f}", f"{_pct(ms, 99):.1f}"] if ms else ["–", "–"]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = [
        "label",
        "input tok/s",
        "output tok/s",
        "total tok/s",
        "p50 TTFT ms",
        "p99 TTFT ms",
        "p50 ITL ms",
        "p99 ITL ms",
        "p50 E2E ms",
        "p99 E2E ms",
    ]
    table = (
        "<table border='1' cellpadding='4' style='border-collapse:collapse'><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )
    return (
        HTML_HEAD.format(title=heading)
        + f"<h3>{heading}</h3>\n{table}\n{_figure_svg(bench_figure(series, title))}\n</body></html>\n"
    )


def _pct(sorted_values: Sequence[float], p: float) -> float:
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)
