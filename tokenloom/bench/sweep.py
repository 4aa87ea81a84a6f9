"""`tokenloom bench sweep`: one workload, one knob varied, everything else fixed, on the real engine.

Tuning advice (as in vLLM's "Optimization and Tuning" docs): change one knob at a time and record
queue time, TTFT, ITL/TPOT, E2E percentiles, throughput and preemptions. The model is loaded once;
every point gets a fresh scheduler, and repeats cycle through the points so slow drifts of the
machine hit all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from tokenloom.config import engine_args
from tokenloom.engine.args import add_engine_args, engine_config_from_args

# Knobs a fresh scheduler can change without reloading the model.
SWEEPABLE = tuple(a.name for a in engine_args() if not a.reload)


def register(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("sweep", help="vary one scheduler knob over one workload on the real engine")
    add_engine_args(p)
    p.add_argument("--sweep", required=True, metavar="KNOB=v1,v2,...",
                   help=f"one of: {', '.join(k.replace('_', '-') for k in SWEEPABLE)}")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-path", default=None, help="JSONL workload (id, arrival_s, prompt_token_ids, max_tokens)")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--input-len", type=int, default=256)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--range-ratio", type=float, default=0.5)
    w.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate for random prompts")
    w.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("-o", "--output-prefix", default="sweep", help="writes PREFIX.json and PREFIX.png")
    p.add_argument("--trace-prefix", default=None, help="also write a step trace per point: PREFIX.KNOB=V.jsonl")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tokenloom.bench.engine_runs import run_on_engine
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.workload.build import engine_workload
    from tokenloom.workload.sweep import format_table, parse_sweep

    sweep = parse_sweep(args.sweep)
    if sweep.knob not in SWEEPABLE:
        raise ValueError(f"bench sweep cannot vary {sweep.knob} without reloading the model; "
                         f"one of: {', '.join(SWEEPABLE)}")
    requests = engine_workload(args.dataset_path, num_prompts=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, range_ratio=args.range_ratio, seed=args.workload_seed,
                               request_rate=args.request_rate)
    config = engine_config_from_args(args)
    print(f"bench sweep: loading {config.model or 'the default model'}", file=sys.stderr, flush=True)
    engine = LLMEngine(config)
    per_point: dict[str, list[Any]] = {label: [] for label in sweep.labels}
    for rep in range(args.repeats):
        for value, label in zip(sweep.values, sweep.labels):
            trace = f"{args.trace_prefix}.{sweep.knob}={label}.jsonl" if args.trace_prefix and rep == 0 else None
            res = run_on_engine(engine, requests, {sweep.knob: value}, trace=trace,
                                label=f"bench sweep [{rep + 1}/{args.repeats}] {sweep.knob}={label}")
            per_point[label].append(res)
            print(f"[{rep + 1}/{args.repeats}] {sweep.knob}={label}: {res.metrics['duration']:.1f} s, "
                  f"{res.num_preemptions} preemptions", file=sys.stderr)
    rows = []
    summary = {}
    for label, results in per_point.items():
        metrics = _median_metrics([r.metrics for r in results])
        preempt = int(statistics.median(r.num_preemptions for r in results))
        steps = int(statistics.median(r.num_steps for r in results))
        rows.append((label, metrics, preempt, steps))
        summary[label] = {"metrics": metrics, "preemptions": preempt, "steps": steps}
    print(format_table(sweep.knob, rows))
    out = Path(args.output_prefix)
    with open(out.with_suffix(".json"), "w") as f:
        json.dump({"knob": sweep.knob, "repeats": args.repeats, "model": engine.model_name,
                   "dtype": str(engine.dtype).replace("torch.", ""), "points": summary}, f, indent=1)
    plot_tradeoff(sweep.knob, rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def _median_metrics(all_metrics: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in all_metrics[0].items() if isinstance(v, int | float) and v is not None]
    return {k: statistics.median(m[k] for m in all_metrics if m.get(k) is not None) for k in keys}


def plot_tradeoff(knob: str, rows: list[tuple[str, dict[str, Any], int, int]], path: Path) -> None:
    """TTFT, ITL, throughput and preemptions against the knob: the latency/throughput trade-off of one knob."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r[0] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [
        ("TTFT (ms)", [("p50", "median_ttft_ms"), ("p99", "p99_ttft_ms")]),
        ("ITL (ms)", [("p50", "median_itl_ms"), ("p99", "p99_itl_ms")]),
        ("output tok/s", [("", "output_throughput")]),
    ]
    for ax, (title, series) in zip(axes, panels):
        for name, key in series:
            ax.plot(x, [r[1].get(key, float("nan")) for r in rows], marker="o", label=name or None)
        ax.set_title(title)
        if any(name for name, _ in series):
            ax.legend()
    axes[3].bar(x, [r[2] for r in rows], color="tab:red")
    axes[3].set_title("preemptions")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel(knob)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
