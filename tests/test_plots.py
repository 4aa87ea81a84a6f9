"""Timeline and bench plots: render synthetic step traces and result files, check the files are real."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest
from matplotlib.image import imread

from tokenloom.bench import cli as bench_cli
from tokenloom.bench.plots import (
    choose_mode,
    load_bench_result,
    parse_steps,
    plot_bench,
    plot_timeline,
    select_steps,
    step_blocks,
)

# ------------------------------------------------------------------------------------- synthetic traces


def seeds_example_trace() -> list[dict]:
    """The seeds' worked example (budget 6, chunk 4): A(P4,G2) B(P8,G3) at step 0, C(P3,G2) at step 1."""
    plans = [
        ({"A": 4, "B": 2}, {"A": 4, "B": 2}, {}),
        ({"A": 1, "B": 4, "C": 1}, {"B": 4, "C": 1}, {"A": 1}),
        ({"B": 2, "C": 2}, {"B": 2, "C": 2}, {}),
        ({"B": 1, "C": 1}, {}, {"B": 1, "C": 1}),
        ({"B": 1}, {}, {"B": 1}),
    ]
    finished = [[], ["A"], [], ["C"], ["B"]]
    waiting = [0, 0, 0, 0, 0]
    running = [2, 3, 2, 2, 1]
    trace, t = [], 0.0
    for i, (sched, pre, dec) in enumerate(plans):
        used = sum(sched.values())
        dt = 0.004 + 0.0005 * used
        trace.append(
            {
                "step": i,
                "t_start": t,
                "t_end": t + dt,
                "scheduled": sched,
                "prefill": pre,
                "decode": dec,
                "budget": 6,
                "budget_used": used,
                "budget_left": 6 - used,
                "num_running": running[i],
                "num_waiting": waiting[i],
                "kv_blocks_used": 2 + i % 2,
                "kv_blocks_free": 6,
                "kv_blocks_cached": 0,
                "num_blocks": 8,
                "preempted": [],
                "finished": finished[i],
                "cached_tokens": {},
                "bound_by": "budget" if used == 6 else "nothing",
            }
        )
        t += dt
    return trace


@dataclass
class _Req:
    id: str
    arrival: int
    prompt: int
    output: int
    computed: int = 0
    sampled: int = 0
    blocks: int = 0

    @property
    def logical(self) -> int:
        return self.prompt + self.sampled


def simulated_trace(
    n_requests: int = 12,
    *,
    budget: int = 64,
    chunk: int = 32,
    max_seqs: int = 6,
    num_blocks: int = 24,
    block_size: int = 8,
    seed: int = 0,
    arrivals_per_step: float = 0.5,
) -> list[dict]:
    """A tiny FCFS scheduler (running first, chunked prefill, recompute preemption of the newest
    running request when KV blocks run out) that writes the engine's step-trace format."""
    rng = random.Random(seed)
    reqs, arrival = [], 0.0
    for i in range(n_requests):
        reqs.append(_Req(f"r{i}", int(arrival), rng.randint(8, 96), rng.randint(4, 40)))
        arrival += rng.expovariate(arrivals_per_step)
    pending, waiting, running = deque(reqs), deque(), []
    free, trace, t, step = num_blocks, [], 0.0, 0
    blocks_for = lambda tokens: math.ceil(tokens / block_size)
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        plan: dict[str, int] = {}
        left, preempted = budget, []
        for r in list(running):
            if r not in running or left == 0:
                continue
            n = min(r.logical - r.computed, left, chunk)
            need = blocks_for(r.computed + n) - r.blocks
            while need > free and running[-1] is not r:
                victim = running.pop()
                free += victim.blocks
                victim.blocks, victim.computed = 0, 0
                left += plan.pop(victim.id, 0)
                waiting.appendleft(victim)
                preempted.append(victim.id)
            if need > free:
                continue
            free -= need
            r.blocks += need
            plan[r.id] = n
            left -= n
        while not preempted and waiting and left > 0 and len(running) < max_seqs:
            r = waiting[0]
            n = min(r.logical - r.computed, left, chunk)
            need = blocks_for(r.computed + n) - r.blocks
            if need > free:
                break
            waiting.popleft()
            running.append(r)
            free -= need
            r.blocks += need
            plan[r.id] = n
            left -= n
        by_id = {r.id: r for r in running}
        prefill = {rid: n for rid, n in plan.items() if by_id[rid].computed < by_id[rid].prompt or n > 1}
        decode = {rid: n for rid, n in plan.items() if rid not in prefill}
        finished = []
        for rid, n in plan.items():
            r = by_id[rid]
            r.computed += n
            if r.computed == r.logical:
                r.sampled += 1
            if r.sampled == r.output:
                finished.append(rid)
                running.remove(r)
                free += r.blocks
        used = budget - left
        dt = 0.003 + 0.00004 * used
        bound = (
            "budget"
            if left == 0
            else "max_num_seqs"
            if waiting and len(running) >= max_seqs
            else ("kv_blocks" if waiting else "nothing")
        )
        trace.append(
            {
                "step": step,
                "t_start": t,
                "t_end": t + dt,
                "scheduled": plan,
                "prefill": prefill,
                "decode": decode,
                "budget": budget,
                "budget_used": used,
                "budget_left": left,
                "num_running": len(running),
                "num_waiting": len(waiting),
                "kv_blocks_used": num_blocks - free,
                "kv_blocks_free": free,
                "kv_blocks_cached": min(free, 3 * len(finished) + step % 4),
                "num_blocks": num_blocks,
                "preempted": preempted,
                "finished": finished,
                "cached_tokens": {},
                "bound_by": bound,
            }
        )
        t += dt + 0.0005
        step += 1
        if step > 20_000:
            raise RuntimeError("synthetic scheduler did not drain")
    return trace


def _write_trace(trace: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in trace))
    return path


def _check_png(path: Path, min_kb: int = 20) -> None:
    assert path.stat().st_size > min_kb * 1024
    img = imread(path)
    h, w = img.shape[:2]
    assert h >= 600 and w >= 800


# ------------------------------------------------------------------------------------------------- tests


def test_step_blocks_stack_in_scheduler_order() -> None:
    step = {"scheduled": {"B": 5, "A": 3, "C": 2}, "prefill": {"B": 4}, "decode": {"A": 3}}
    blocks = [(b.req_id, b.kind, b.tokens, b.bottom) for b in step_blocks(step)]
    # B's fifth token is listed under neither: drawn as decode; C (unlisted) likewise
    assert blocks == [
        ("B", "prefill", 4, 0),
        ("B", "decode", 1, 4),
        ("A", "decode", 3, 5),
        ("C", "decode", 2, 8),
    ]


def test_parse_and_select_steps() -> None:
    trace = [{"step": i} for i in range(10)]
    assert (
        parse_steps("2:5") == (2, 5) and parse_steps(":3") == (None, 3) and parse_steps(None) == (None, None)
    )
    assert [s["step"] for s in select_steps(trace, (2, 5))] == [2, 3, 4]
    assert [s["step"] for s in select_steps(trace, (8, None))] == [8, 9]
    with pytest.raises(ValueError):
        parse_steps("7")


def test_timeline_png_seeds_example(tmp_path: Path) -> None:
    out = plot_timeline(seeds_example_trace(), tmp_path / "seeds.png")
    _check_png(out)


# The seeds example drawn by hand: (step, request, kind, bottom, tokens) of every block in the token panel.
SEEDS_BLOCKS = [
    (0, "A", "prefill", 0, 4), (0, "B", "prefill", 4, 2),
    (1, "A", "decode", 0, 1), (1, "B", "prefill", 1, 4), (1, "C", "prefill", 5, 1),
    (2, "B", "prefill", 0, 2), (2, "C", "prefill", 2, 2),
    (3, "B", "decode", 0, 1), (3, "C", "decode", 1, 1),
    (4, "B", "decode", 0, 1),
]


def test_timeline_png_draws_each_block_where_the_trace_says() -> None:
    """The PNG's token panel, read back from the figure: one bar per (step, request, kind), at the
    step's column, stacked in scheduler order, as tall as its tokens; under each column the budget."""
    from matplotlib.collections import PolyCollection

    from tokenloom.bench.timeline_png import timeline_figure

    ax = timeline_figure(seeds_example_trace()).axes[0]
    drawn = {"budget": [], "prefill": [], "decode": []}
    for coll in ax.collections:
        if not isinstance(coll, PolyCollection):
            continue
        kind = "prefill" if coll.get_hatch() == "///" else ("decode" if coll.get_zorder() == 2 else "budget")
        for path in coll.get_paths():
            x, y = path.vertices[:, 0], path.vertices[:, 1]
            drawn[kind].append((round(float(x.mean())), round(float(y.min()), 3), round(float(y.max() - y.min()), 3)))
    for kind in ("prefill", "decode"):
        want = sorted((step, float(bottom), float(tokens)) for step, _, k, bottom, tokens in SEEDS_BLOCKS if k == kind)
        assert sorted(drawn[kind]) == want, kind
    assert sorted(drawn["budget"]) == [(step, 0.0, 6.0) for step in range(5)]


def test_timeline_svg_draws_each_block_where_the_trace_says(tmp_path: Path) -> None:
    """The HTML's SVG, read back: rect positions per request, in pixels, against the hand-drawn blocks."""
    html = plot_timeline(seeds_example_trace(), tmp_path / "seeds.html").read_text()
    svg = ET.fromstring(html[html.index("<svg") : html.index("</svg>") + len("</svg>")])
    rects = [r for r in svg.iter() if r.tag.endswith("rect")]
    budgets = sorted((r for r in rects if r.get("stroke") == "#ccc"), key=lambda r: float(r.get("x")))
    assert len(budgets) == 5
    unit = float(budgets[0].get("height")) / 6  # pixels per token
    floor = float(budgets[0].get("y")) + float(budgets[0].get("height"))  # y of token 0
    blocks = [r for r in rects if r.get("class") == "blk" and r.get("data-req")]
    columns = [float(b.get("x")) for b in budgets]
    got = []
    for r in blocks:
        step = columns.index(float(r.get("x")))
        height = float(r.get("height")) / unit
        bottom = (floor - float(r.get("y")) - float(r.get("height"))) / unit
        got.append((step, r.get("data-req"), round(bottom, 1), round(height, 1)))
    assert sorted(got) == sorted((st, req, float(b), float(t)) for st, req, _, b, t in SEEDS_BLOCKS)
    assert columns == sorted(columns) and len(set(columns)) == 5  # one column per step, left to right


def test_timeline_with_preemption_png_and_html(tmp_path: Path) -> None:
    trace = simulated_trace(12, num_blocks=20, seed=1)
    assert any(s["preempted"] for s in trace), "the synthetic trace should preempt"
    trace[3]["bound_by"] = "batch"  # a reason the plots do not know still gets a colour and a legend
    path = _write_trace(trace, tmp_path / "trace.jsonl")
    _check_png(plot_timeline(path, tmp_path / "t.png"))
    html = plot_timeline(path, tmp_path / "t.html").read_text()
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert 'data-req="r0"' in html and "request r3:" in html and "preempted" in html
    assert "bound by batch" in html
    svg = html[html.index("<svg") : html.index("</svg>") + len("</svg>")]
    assert ET.fromstring(svg).tag.endswith("svg")  # well-formed, so browsers render all of it
    embedded = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', html, re.S)
    assert json.loads(embedded.group(1)) == trace
    victim = next(s for s in trace if s["preempted"])
    assert f"step {victim['step']}: preempted {victim['preempted'][0]}" in html


def test_long_trace_windows_and_aggregates(tmp_path: Path) -> None:
    trace = simulated_trace(
        150, budget=256, chunk=128, max_seqs=32, num_blocks=200, seed=2, arrivals_per_step=2
    )
    assert len(trace) > 150
    assert choose_mode(trace, "auto", 40) == "aggregate"
    window = select_steps(trace, (0, 30))
    assert choose_mode(window, "auto", 40) == "requests"
    _check_png(plot_timeline(trace, tmp_path / "all.png"))
    _check_png(plot_timeline(trace, tmp_path / "window.png", steps=(0, 30)))
    html = plot_timeline(trace, tmp_path / "all.html")
    assert "tokens over" in html.read_text()  # aggregate hover titles
    with pytest.raises(ValueError):
        plot_timeline(trace, tmp_path / "none.png", steps=(10**6, None))
    with pytest.raises(ValueError):
        plot_timeline(trace, tmp_path / "bad.txt")


def _fake_result(path: Path, scale: float, vllm_style: bool = False) -> Path:
    rng = random.Random(int(scale * 100))
    ttfts = [scale * (0.05 + rng.expovariate(20)) for _ in range(40)]
    itls = [[scale * (0.01 + rng.expovariate(300)) for _ in range(15)] for _ in range(40)]
    data = {
        "ttfts": ttfts,
        "itls": itls,
        "output_throughput": 900 / scale,
        "total_token_throughput": 2400 / scale,
        "request_throughput": 5 / scale,
        "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts),
    }
    if not vllm_style:
        data["e2els"] = [t + sum(g) for t, g in zip(ttfts, itls)]
        data["input_throughput"] = 1500 / scale
    path.write_text(json.dumps(data))
    return path


def test_bench_plot_png_and_html(tmp_path: Path) -> None:
    a = _fake_result(tmp_path / "baseline.json", 1.0)
    b = _fake_result(tmp_path / "chunk512.json", 1.3, vllm_style=True)
    series = load_bench_result(b)
    assert series.label == "chunk512" and not series.e2els_s
    assert series.throughput["input tok/s"] == pytest.approx(1500 / 1.3)
    _check_png(plot_bench([a, b], tmp_path / "cmp.png"), min_kb=30)
    html = plot_bench([a, b], tmp_path / "cmp.html", labels=["base", "c512"]).read_text()
    assert "<svg" in html and "c512" in html and "p99 TTFT ms" in html
    with pytest.raises(ValueError):
        plot_bench([a, b], tmp_path / "x.png", labels=["only-one"])


def test_plot_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tokenloom")
    bench_cli.register(parser.add_subparsers(dest="command"))
    trace = _write_trace(seeds_example_trace(), tmp_path / "trace.jsonl")
    for argv in (
        ["plot", "timeline", str(trace), "-o", str(tmp_path / "t.html"), "--steps", "1:4"],
        ["plot", "bench", str(_fake_result(tmp_path / "r.json", 1.0)), "-o", str(tmp_path / "b.png")],
    ):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
    html = (tmp_path / "t.html").read_text()
    assert "request B: prefill 4 tokens" in html and "step 0 " not in html  # windowed to steps 1..3
    assert (tmp_path / "b.png").stat().st_size > 10_000
    assert capsys.readouterr().out.count("wrote") == 2
