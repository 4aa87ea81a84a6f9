"""The schedule timeline as one self-contained HTML page (inline SVG, data embedded, no network):
the same panels as timeline_png.py, with a tooltip per block.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.bench.plot_common import (
    DECODE_AGG_COLOR,
    DEFAULT_MAX_REQUESTS,
    HTML_HEAD,
    PREFILL_AGG_COLOR,
    bound_colors,
    choose_mode,
    lighten,
    request_colors,
    select_steps,
    step_blocks,
    step_intervals,
    step_ms,
    step_totals,
    trace_title,
)

# ----------------------------------------------------------------------------------------- timeline HTML


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
        fill = lighten(color) if b.kind == "prefill" else color
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
    pre, dec = step_totals(step)
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
        ms = step_ms(s)
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


def _svg_overlap_panel(rows: Sequence[tuple[float, float, float]], steps: Sequence[dict], x0: float, cw: float,
                       panel: _Panel) -> list[str]:  # fmt: skip
    """Per step: execute (blue), host work (orange; hatched = the part that overlapped a step's
    execution, which async scheduling hides)."""
    out = [f'<text x="4" y="{panel.top + 12:.1f}">exec / host (ms)</text>']
    for i, ((ex, host, hidden), s) in enumerate(zip(rows, steps)):
        x = x0 + i * cw
        tip = f"step {s['step']}: execute {ex:.2f} ms, host {host:.2f} ms ({hidden:.2f} ms overlapped execution)"
        out.append(_svg_rect(x, panel.y(ex), cw * 0.45, panel.top + panel.height - panel.y(ex), "#3182bd", tip))
        out.append(_svg_rect(x + cw * 0.45, panel.y(host), cw * 0.45, panel.top + panel.height - panel.y(host),
                             "#fd8d3c", tip))  # fmt: skip
        if hidden > 0:
            out.append(_svg_rect(x + cw * 0.45, panel.y(hidden), cw * 0.45,
                                 panel.top + panel.height - panel.y(hidden), "url(#hatch)", tip))  # fmt: skip
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
    top_tokens = max([int(s.get("budget") or 0) for s in view] + [sum(step_totals(s)) for s in view] + [1])
    tokens = _Panel(top=20, height=300, vmax=top_tokens * 1.05)
    kv = _Panel(top=340, height=110, vmax=max([s.get("num_blocks", 0) or 0 for s in view] + [1]))
    queues = _Panel(
        top=470,
        height=90,
        vmax=max([max(s.get("num_running", 0), s.get("num_waiting", 0)) for s in view] + [1]),
    )
    times = _Panel(top=580, height=90, vmax=max([step_ms(s) for s in view] + [1e-9]))
    height = times.top + times.height + 30
    intervals = step_intervals(view)
    overlap = None
    if intervals is not None:
        overlap = _Panel(top=height - 10, height=90, vmax=max([max(r[0], r[1]) for r in intervals] + [1e-9]))
        height = overlap.top + overlap.height + 30
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
    if intervals is not None and overlap is not None:
        parts += _svg_overlap_panel(intervals, view, x0, cw, overlap)
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
    heading = html.escape(trace_title(view, title))
    return (
        HTML_HEAD.format(title=heading)
        + f"<h3>{heading}</h3>\n{legend}\n<div class='scroll'>{''.join(parts)}</div>\n"
        + "<p>Columns: one engine step, height = token budget; hatched = prefill, solid = decode; red "
        "triangles = preemptions. Hover a block for details. KV: used (green), cached (dashed), pool "
        "(black dashed). Step time is coloured by what bound the step. Exec / host (traces with step "
        "intervals): execute time (blue) and host time, schedule + update (orange), hatched where it "
        "overlapped a step's execution (hidden by --async-scheduling).</p>\n"
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
