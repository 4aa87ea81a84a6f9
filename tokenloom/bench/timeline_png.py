"""The schedule timeline as a matplotlib figure (PNG, SVG or PDF): one column per step whose height
is the token budget, a stacked block per request, and below it KV blocks, queue lengths and the
step's duration coloured by what bound it (see plots.py for the whole picture).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from tokenloom.bench.plot_common import (
    DECODE_AGG_COLOR,
    DEFAULT_MAX_REQUESTS,
    PREFILL_AGG_COLOR,
    bound_colors,
    choose_mode,
    lighten,
    request_colors,
    select_steps,
    step_blocks,
    step_ms,
    step_totals,
    trace_title,
)

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
                    # drafts under verification: light tint, dotted
                    fills.append(color if kind == "decode" else lighten(color))
                    edges.append("white" if kind == "decode" else color)
        hatch = {"prefill": "///", "draft": "..."}.get(kind)
        _bars(ax, xs, heights, bottoms, facecolors=fills, edgecolors=edges, linewidths=0.6, hatch=hatch)
    _label_blocks(ax, steps)


# Rough geometry of the token panel, enough to decide whether a label fits inside its block.
_CHAR_PX, _LINE_PX, _PANEL_PX = 4.6, 11.0, 420.0


def _label_blocks(ax: Any, steps: Sequence[dict]) -> None:
    """Write "req:tokens" inside blocks large enough to hold it, like a hand-drawn step table;
    across the block when the column is wide enough, else along it."""
    if len(steps) > 60:
        return
    fig_px = ax.figure.get_figwidth() * ax.figure.dpi
    col_px = 0.8 * fig_px * 0.85 / len(steps)
    top = max([int(s.get("budget") or 0) for s in steps] + [sum(step_totals(s)) for s in steps] + [1])
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
    totals = [step_totals(s) for s in steps]
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
    top = max(budgets + [sum(step_totals(s)) for s in steps] + [1])
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


def _draw_time_panel(ax: Any, steps: Sequence[dict]) -> None:
    xs = [s["step"] for s in steps]
    bound = [s.get("bound_by") or "nothing" for s in steps]
    palette = bound_colors(steps)
    _bars(
        ax, xs, [step_ms(s) for s in steps], width=0.9, facecolors=[palette[b] for b in bound], linewidths=0
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
    fig.suptitle(trace_title(view, title) + ("" if mode == "requests" else "  [aggregated: too many requests]"))
    return fig
