"""Pictures of a schedule (engine step traces) and of benchmark results.

Timeline (`plot_timeline`): the seeds' picture. One column per step whose height is the token
budget; inside it a stacked block per request sized by its scheduled tokens (prefill hatched and
light, decode solid, one colour per request for the whole trace), red triangles above a column for
preemptions. Below, on the same step axis: KV blocks used/cached against the pool size, running and
waiting queue lengths, and the step's duration coloured by what bound it. Long traces: pick a window
with `steps=(a, b)`; when the window holds too many requests or blocks to tell apart, the columns
fall back to two aggregate stacks (all prefill, all decode tokens).

Bench (`plot_bench`): latency CDFs (TTFT, ITL, E2E) with one line per result file, and throughput
bars. Result files are ours or vLLM's (`--result-file` / `--save-result` JSON).

Both write PNG (matplotlib, Agg canvas, no pyplot state) or one self-contained HTML file (inline SVG,
data embedded, no network).
"""

from __future__ import annotations

import html
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

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


def _totals(step: dict) -> tuple[int, int]:
    blocks = step_blocks(step)
    prefill = sum(b.tokens for b in blocks if b.kind == "prefill")
    return prefill, sum(b.tokens for b in blocks) - prefill


def _step_ms(step: dict) -> float:
    return (float(step.get("t_end", 0.0)) - float(step.get("t_start", 0.0))) * 1000.0


def _title(steps: Sequence[dict], title: str | None) -> str:
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


def _lighten(hex_color: str, amount: float = 0.55) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * amount)
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


# ------------------------------------------------------------------------------------------ timeline PNG


def _bars(
    ax: Any,
    xs: Sequence[float],
    heights: Sequence[float],
    bottoms: Sequence[float] | None = None,
    *,
    width: float = 0.8,
    zorder: float = 2,
    **style: Any,
) -> None:
    """Bars as one PolyCollection: ax.bar makes an artist per bar, far too slow for 10^4-10^5 blocks."""
    bottoms = bottoms if bottoms is not None else [0.0] * len(xs)
    half = width / 2
    verts = [
        [(x - half, y0), (x - half, y0 + h), (x + half, y0 + h), (x + half, y0)]
        for x, h, y0 in zip(xs, heights, bottoms)
    ]
    if not verts:
        return
    ax.add_collection(PolyCollection(verts, zorder=zorder, **style))
    ax.update_datalim([(min(xs) - half, 0.0), (max(xs) + half, max(h + y for h, y in zip(heights, bottoms)))])
    ax.autoscale_view()


def _step_curve(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """Edges for a `where="post"` step plot that spans each step's full column (x-0.5 .. x+0.5)."""
    return [x - 0.5 for x in xs] + [xs[-1] + 0.5], list(ys) + [ys[-1]]


def _side_legend(ax: Any, **kwargs: Any) -> None:
    # right of the panel: inside it, a legend hides the columns and preemption markers it sits on
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, **kwargs)


def _draw_columns_requests(ax: Any, steps: Sequence[dict], colors: dict[str, str]) -> None:
    for kind in ("prefill", "decode", "draft"):
        xs, heights, bottoms, fills, edges = [], [], [], [], []
        for s in steps:
            for b in step_blocks(s):
                if b.kind == kind:
                    xs.append(s["step"])
                    heights.append(b.tokens)
                    bottoms.append(b.bottom)
                    color = colors[b.req_id]
                    # prefill: light tint hatched in the request's own colour (hatches follow the edge)
                    fills.append(color if kind == "decode" else _lighten(color))
                    edges.append("white" if kind == "decode" else color)
        hatch = {"prefill": "///", "draft": "..."}.get(kind)
        _bars(ax, xs, heights, bottoms, facecolors=fills, edgecolors=edges, linewidths=0.6, hatch=hatch)
    _label_blocks(ax, steps)


# Rough geometry of the token panel, enough to decide whether a label fits inside its block.
_CHAR_PX, _LINE_PX, _PANEL_PX = 4.6, 11.0, 420.0


def _label_blocks(ax: Any, steps: Sequence[dict]) -> None:
    """Write "req:tokens" inside blocks large enough to hold it, like the seeds' step tables;
    across the block when the column is wide enough, else along it."""
    if len(steps) > 60:
        return
    fig_px = ax.figure.get_figwidth() * ax.figure.dpi
    col_px = 0.8 * fig_px * 0.85 / len(steps)
    top = max([int(s.get("budget") or 0) for s in steps] + [sum(_totals(s)) for s in steps] + [1])
    px_per_token = _PANEL_PX / (top * 1.2)
    box = {"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7}
    for s in steps:
        for b in step_blocks(s):
            text = f"{b.req_id}:{b.tokens}"
            text_px, block_px = len(text) * _CHAR_PX, b.tokens * px_per_token
            if text_px <= col_px and block_px >= _LINE_PX:
                rotation = 0
            elif col_px >= _LINE_PX and block_px >= text_px:
                rotation = 90
            else:
                continue
            y = b.bottom + b.tokens / 2
            ax.text(
                s["step"],
                y,
                text,
                ha="center",
                va="center",
                rotation=rotation,
                fontsize=7,
                zorder=3,
                bbox=box,
            )


def _draw_columns_aggregate(ax: Any, steps: Sequence[dict]) -> None:
    # decode at the bottom: a steady band (≈ running requests) with the prefill bursts riding on top
    xs = [s["step"] for s in steps]
    totals = [_totals(s) for s in steps]
    pre = [p for p, _ in totals]
    dec = [d for _, d in totals]
    hatch = "///" if len(steps) <= 300 else None  # at a few pixels per column hatching is only noise
    _bars(ax, xs, dec, width=0.9, facecolors=DECODE_AGG_COLOR, linewidths=0)
    _bars(
        ax,
        xs,
        pre,
        dec,
        width=0.9,
        facecolors=PREFILL_AGG_COLOR,
        edgecolors="#3182bd",
        linewidths=0,
        hatch=hatch,
    )


def _draw_token_panel(ax: Any, steps: Sequence[dict], mode: str, colors: dict[str, str]) -> None:
    xs = [s["step"] for s in steps]
    budgets = [int(s.get("budget") or 0) for s in steps]
    thin = len(steps) > 300  # column outlines would paint the whole panel grey
    _bars(
        ax,
        xs,
        budgets,
        width=0.9 if not thin else 1.0,
        zorder=1,
        facecolors="#f0f0f0",
        edgecolors="#c8c8c8",
        linewidths=0 if thin else 0.5,
    )
    if mode == "requests":
        _draw_columns_requests(ax, steps, colors)
    else:
        _draw_columns_aggregate(ax, steps)
    top = max(budgets + [sum(_totals(s)) for s in steps] + [1])
    pre_x = [s["step"] for s in steps if s.get("preempted")]
    if pre_x:
        ax.scatter(pre_x, [top * 1.06] * len(pre_x), marker="v", s=40, color="#e41a1c", zorder=4)
        if len(steps) <= 60:
            for s in steps:
                if s.get("preempted"):
                    victims = ",".join(map(str, s["preempted"]))
                    ax.text(s["step"], top * 1.12, victims, ha="center", fontsize=7, color="#e41a1c")
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("scheduled tokens\n(column = budget)")
    handles = [
        Patch(facecolor="#f0f0f0", edgecolor="#c8c8c8", label="token budget"),
        Patch(facecolor="#dddddd", hatch="///", edgecolor="#666666", label="prefill (light, hatched)"),
        Patch(facecolor="#555555", label="decode (solid)"),
    ]
    if mode != "aggregate" and any(s.get("spec") for s in steps):
        handles.append(Patch(facecolor="#dddddd", hatch="...", edgecolor="#666666", label="draft tokens (dotted)"))
    if mode == "aggregate":
        handles[1:3] = [
            Patch(
                facecolor=PREFILL_AGG_COLOR, hatch="///", edgecolor="#3182bd", label="prefill, all requests"
            ),
            Patch(facecolor=DECODE_AGG_COLOR, label="decode, all requests"),
        ]
    if pre_x:
        handles.append(Line2D([], [], marker="v", color="#e41a1c", lw=0, label="preempted"))
    _side_legend(ax, handles=handles)


def _draw_kv_panel(ax: Any, steps: Sequence[dict]) -> None:
    xs = [s["step"] for s in steps]
    ex, used = _step_curve(xs, [s.get("kv_blocks_used", 0) for s in steps])
    ax.fill_between(ex, used, step="post", color="#74c476", alpha=0.6, label="used", lw=0)
    ax.step(
        *_step_curve(xs, [s.get("kv_blocks_cached", 0) for s in steps]),
        where="post",
        color="#006d2c",
        lw=1.2,
        label="cached",
    )
    ax.step(
        *_step_curve(xs, [s.get("num_blocks", 0) for s in steps]),
        where="post",
        color="black",
        ls="--",
        lw=1,
        label="pool size",
    )
    ax.set_ylabel("KV blocks")
    ax.set_ylim(bottom=0)
    _side_legend(ax)


def _draw_queue_panel(ax: Any, steps: Sequence[dict]) -> None:
    xs = [s["step"] for s in steps]
    for key, color in (("num_running", "#2171b5"), ("num_waiting", "#cb181d")):
        ax.step(*_step_curve(xs, [s.get(key, 0) for s in steps]), where="post", color=color, label=key[4:])
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0)
    _side_legend(ax)


def bound_colors(steps: Sequence[dict]) -> dict[str, str]:
    """Colour per `bound_by` value present, known reasons first; unknown ones still get their own."""
    present = {s.get("bound_by") or "nothing" for s in steps}
    out = {b: c for b, c in BOUND_COLORS.items() if b in present}
    for i, b in enumerate(sorted(present - set(BOUND_COLORS))):
        out[b] = EXTRA_BOUND_COLORS[i % len(EXTRA_BOUND_COLORS)]
    return out


def _draw_time_panel(ax: Any, steps: Sequence[dict]) -> None:
    xs = [s["step"] for s in steps]
    bound = [s.get("bound_by") or "nothing" for s in steps]
    palette = bound_colors(steps)
    _bars(
        ax, xs, [_step_ms(s) for s in steps], width=0.9, facecolors=[palette[b] for b in bound], linewidths=0
    )
    ax.set_ylabel("step time (ms)")
    _side_legend(ax, handles=[Patch(color=c, label=f"bound by {b}") for b, c in palette.items()])


def timeline_figure(
    trace: Sequence[dict],
    *,
    steps: tuple[int | None, int | None] = (None, None),
    mode: str = "auto",
    max_requests: int = DEFAULT_MAX_REQUESTS,
    title: str | None = None,
) -> Figure:
    view = select_steps(trace, steps)
    if not view:
        raise ValueError("no steps to plot (empty trace or window)")
    mode = choose_mode(view, mode, max_requests)
    colors = request_colors(trace)
    width = min(28.0, max(10.0, 0.28 * len(view)))
    fig = Figure(figsize=(width, 10.5), dpi=100, layout="constrained")
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [3.2, 1.2, 1.0, 1.0]})
    _draw_token_panel(axes[0], view, mode, colors)
    _draw_kv_panel(axes[1], view)
    _draw_queue_panel(axes[2], view)
    _draw_time_panel(axes[3], view)
    axes[-1].set_xlabel("engine step")
    if len(view) <= 40:
        axes[-1].set_xticks([s["step"] for s in view])
    for ax in axes:
        ax.grid(axis="y", color="#e6e6e6", lw=0.6, zorder=0)
        ax.set_axisbelow(True)
    fig.suptitle(_title(view, title) + ("" if mode == "requests" else "  [aggregated: too many requests]"))
    return fig


# ----------------------------------------------------------------------------------------- timeline HTML

_HTML_HEAD = """<!doctype html>
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

_HTML_SCRIPT = """<script>
// Hovering a block outlines every block of the same request, to follow it across steps.
document.querySelectorAll('rect.blk').forEach(function (el) {
  el.addEventListener('mouseenter', function () {
    document.querySelectorAll('rect.blk[data-req="' + CSS.escape(el.dataset.req) + '"]')
      .forEach(function (o) { o.classList.add('hl'); });
  });
  el.addEventListener('mouseleave', function () {
    document.querySelectorAll('rect.blk.hl').forEach(function (o) { o.classList.remove('hl'); });
  });
});
</script>
"""


@dataclass
class _Panel:
    top: float
    height: float
    vmax: float

    def y(self, v: float) -> float:
        return (
            self.top + self.height - (v / self.vmax) * self.height
            if self.vmax > 0
            else self.top + self.height
        )


def _svg_rect(x: float, y: float, w: float, h: float, fill: str, title: str, extra: str = "") -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{max(h, 0.0):.1f}" fill="{fill}" '
        f"{extra}><title>{html.escape(title)}</title></rect>"
    )


def _svg_polyline(points: Sequence[tuple[float, float]], color: str, dash: bool = False) -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    style = ' stroke-dasharray="4 3"' if dash else ""
    return f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.3"{style}/>'


def _svg_request_blocks(
    step: dict, colors: dict[str, str], x: float, w: float, panel: _Panel, head: str
) -> str:
    cached = step.get("cached_tokens") or {}
    out: list[str] = []
    for b in step_blocks(step):
        color = colors[b.req_id]
        y, h = panel.y(b.bottom + b.tokens), b.tokens * panel.height / panel.vmax
        tip = f"{head}\nrequest {b.req_id}: {b.kind} {b.tokens} tokens"
        if b.req_id in cached:
            tip += f" (prefix-cache hit {cached[b.req_id]} tokens)"
        fill = _lighten(color) if b.kind == "prefill" else color
        attrs = f'class="blk" data-req="{html.escape(b.req_id)}" stroke="white" stroke-width="0.5"'
        out.append(_svg_rect(x, y, w, h, fill, tip, attrs))
        if b.kind == "prefill":  # one shared hatch pattern laid over the request's light tint
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="url(#hatch)" ')
            out.append('pointer-events="none"/>')
        if w >= 24 and h >= 12:
            label = f"{html.escape(b.req_id)}:{b.tokens}"
            out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 3:.1f}" text-anchor="middle" ')
            out.append(f'pointer-events="none">{label}</text>')
    return "".join(out)


def _svg_aggregate_blocks(step: dict, x: float, w: float, panel: _Panel, head: str) -> str:
    blocks = step_blocks(step)
    pre, dec = _totals(step)
    n_pre = sum(1 for b in blocks if b.kind == "prefill")
    scale = panel.height / panel.vmax
    tip_pre = f"{head}\nprefill {pre} tokens over {n_pre} requests"
    tip_dec = f"{head}\ndecode {dec} tokens over {len(blocks) - n_pre} requests"
    # same order as the PNG: decode at the bottom, prefill above it
    decode = _svg_rect(x, panel.y(dec), w, dec * scale, DECODE_AGG_COLOR, tip_dec, 'class="blk"')
    prefill = _svg_rect(x, panel.y(dec + pre), w, pre * scale, PREFILL_AGG_COLOR, tip_pre, 'class="blk"')
    return decode + prefill


def _svg_token_columns(
    steps: Sequence[dict], mode: str, colors: dict[str, str], x0: float, cw: float, panel: _Panel
) -> list[str]:
    out: list[str] = []
    w = cw * 0.9
    for i, s in enumerate(steps):
        x = x0 + i * cw
        budget = int(s.get("budget") or 0)
        head = f"step {s['step']}  budget {budget}, used {s.get('budget_used', '?')}"
        height = budget * panel.height / panel.vmax
        out.append(_svg_rect(x, panel.y(budget), w, height, "#f0f0f0", head, 'stroke="#ccc"'))
        if mode == "requests":
            out.append(_svg_request_blocks(s, colors, x, w, panel, head))
        else:
            out.append(_svg_aggregate_blocks(s, x, w, panel, head))
        if s.get("preempted"):
            cx, cy = x + cw * 0.45, panel.top + 6
            tip = f"step {s['step']}: preempted {', '.join(map(str, s['preempted']))}"
            out.append(
                f'<path d="M{cx - 5:.1f},{cy - 5:.1f} L{cx + 5:.1f},{cy - 5:.1f} L{cx:.1f},{cy + 4:.1f} Z" '
                f'fill="#e41a1c"><title>{html.escape(tip)}</title></path>'
            )
    return out


def _svg_series_panel(
    steps: Sequence[dict],
    series: Sequence[tuple[str, str, bool]],
    x0: float,
    cw: float,
    panel: _Panel,
    label: str,
) -> list[str]:
    out = [f'<text x="4" y="{panel.top + 12:.1f}">{html.escape(label)}</text>']
    for key, color, dash in series:
        pts = [(x0 + (i + 0.45) * cw, panel.y(float(s.get(key, 0) or 0))) for i, s in enumerate(steps)]
        out.append(_svg_polyline(pts, color, dash))
    for i, s in enumerate(steps):  # invisible hover targets carrying the numbers
        tip = f"step {s['step']}: " + ", ".join(f"{k} {s.get(k, 0)}" for k, _, _ in series)
        out.append(_svg_rect(x0 + i * cw, panel.top, cw, panel.height, "transparent", tip))
    return out


def _svg_time_panel(steps: Sequence[dict], x0: float, cw: float, panel: _Panel) -> list[str]:
    out = [f'<text x="4" y="{panel.top + 12:.1f}">step time (ms)</text>']
    palette = bound_colors(steps)
    for i, s in enumerate(steps):
        ms = _step_ms(s)
        bound = s.get("bound_by") or "nothing"
        tip = f"step {s['step']}: {ms:.2f} ms, bound by {bound}"
        out.append(
            _svg_rect(
                x0 + i * cw,
                panel.y(ms),
                cw * 0.9,
                panel.top + panel.height - panel.y(ms),
                palette[bound],
                tip,
            )
        )
    return out


def timeline_html(
    trace: Sequence[dict],
    *,
    steps: tuple[int | None, int | None] = (None, None),
    mode: str = "auto",
    max_requests: int = DEFAULT_MAX_REQUESTS,
    title: str | None = None,
) -> str:
    view = select_steps(trace, steps)
    if not view:
        raise ValueError("no steps to plot (empty trace or window)")
    mode = choose_mode(view, mode, max_requests)
    colors = request_colors(trace)
    cw = min(40.0, max(3.0, 1100.0 / len(view)))
    x0 = 90.0
    width = x0 + cw * len(view) + 20
    top_tokens = max([int(s.get("budget") or 0) for s in view] + [sum(_totals(s)) for s in view] + [1])
    tokens = _Panel(top=20, height=300, vmax=top_tokens * 1.05)
    kv = _Panel(top=340, height=110, vmax=max([s.get("num_blocks", 0) or 0 for s in view] + [1]))
    queues = _Panel(
        top=470,
        height=90,
        vmax=max([max(s.get("num_running", 0), s.get("num_waiting", 0)) for s in view] + [1]),
    )
    times = _Panel(top=580, height=90, vmax=max([_step_ms(s) for s in view] + [1e-9]))
    height = times.top + times.height + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="white" stroke-width="2" '
        'stroke-opacity="0.8"/></pattern></defs>',
        f'<text x="4" y="{tokens.top + 12}">tokens</text>',
    ]
    parts += _svg_token_columns(view, mode, colors, x0, cw, tokens)
    parts += _svg_series_panel(
        view,
        [
            ("kv_blocks_used", "#31a354", False),
            ("kv_blocks_cached", "#006d2c", True),
            ("num_blocks", "#000000", True),
        ],
        x0,
        cw,
        kv,
        "KV blocks",
    )
    parts += _svg_series_panel(
        view,
        [("num_running", "#2171b5", False), ("num_waiting", "#cb181d", False)],
        x0,
        cw,
        queues,
        "running / waiting",
    )
    parts += _svg_time_panel(view, x0, cw, times)
    label_every = max(1, math.ceil(40 / cw))
    for i, s in enumerate(view):
        if i % label_every == 0:
            parts.append(
                f'<text x="{x0 + (i + 0.45) * cw:.1f}" y="{height - 12:.0f}" text-anchor="middle">'
                f"{s['step']}</text>"
            )
    parts.append("</svg>")
    legend = _html_legend(view, mode, colors)
    data = json.dumps(view, separators=(",", ":")).replace("</", "<\\/")
    heading = html.escape(_title(view, title))
    return (
        _HTML_HEAD.format(title=heading)
        + f"<h3>{heading}</h3>\n{legend}\n<div class='scroll'>{''.join(parts)}</div>\n"
        + "<p>Columns: one engine step, height = token budget; hatched = prefill, solid = decode; red "
        "triangles = preemptions. Hover a block for details. KV: used (green), cached (dashed), pool "
        "(black dashed). Step time is coloured by what bound the step.</p>\n"
        + f'<script type="application/json" id="trace-data">{data}</script>\n'
        + _HTML_SCRIPT
        + "</body></html>\n"
    )


def _html_legend(steps: Sequence[dict], mode: str, colors: dict[str, str]) -> str:
    sw = lambda color, text: f'<span><i class="sw" style="background:{color}"></i>{html.escape(text)}</span>'
    items = [sw("#f0f0f0", "budget"), sw("#e41a1c", "preempted")]
    if mode == "aggregate":
        items += [
            sw(PREFILL_AGG_COLOR, "prefill (all requests)"),
            sw(DECODE_AGG_COLOR, "decode (all requests)"),
        ]
    else:
        seen = list(dict.fromkeys(str(r) for s in steps for r in (s.get("scheduled") or {})))
        items += [sw(colors[r], r) for r in seen]
    items += [sw(c, f"bound by {b}") for b, c in bound_colors(steps).items()]
    return f"<div class='legend'>{''.join(items)}</div>"


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
        _HTML_HEAD.format(title=heading)
        + f"<h3>{heading}</h3>\n{table}\n{_figure_svg(bench_figure(series, title))}\n</body></html>\n"
    )


def _pct(sorted_values: Sequence[float], p: float) -> float:
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


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
