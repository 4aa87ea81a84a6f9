"""`tokenloom bench throughput`: offline throughput (like `vllm bench throughput`), the batching modes side by side.

N requests with random token prompts and a fixed output length (ignore_eos), all at t=0, through the
engine in this process. The model is loaded once; each mode gets a fresh scheduler (and an empty
prefix cache), and modes alternate when repeated, so they see the same machine conditions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from tokenloom.config import engine_config_from_kwargs
from tokenloom.engine.args import add_engine_args, engine_config_from_args, engine_kwargs_from_args

MODES = ("continuous", "static", "request")


def register(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("throughput", help="offline throughput of the engine; batching modes side by side")
    add_engine_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=128)
    w.add_argument("--input-len", type=int, default=288, help="mean prompt length in tokens")
    w.add_argument("--range-ratio", type=float, default=0.78, help="prompt lengths uniform in len*(1±r): 64..512")
    w.add_argument("--output-len", type=int, default=128)
    w.add_argument("--dataset-path", default=None, help="a JSONL workload (id, prompt_token_ids, max_tokens) instead")
    w.add_argument("--workload-seed", type=int, default=20251129)
    p.add_argument("--modes", default="continuous,static,request", help="batching modes to compare")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=_run)


def build_requests(args: argparse.Namespace) -> list:
    from tokenloom.workload.build import engine_workload

    return engine_workload(args.dataset_path, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=args.output_len, range_ratio=args.range_ratio, seed=args.workload_seed,
                           request_rate=None, fixed_output_len=True)


def _run(args: argparse.Namespace) -> int:
    from tokenloom.bench.engine_runs import run_on_engine
    from tokenloom.engine.llm_engine import LLMEngine

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown batching mode(s) {bad}; choose from {', '.join(MODES)}")
    requests = build_requests(args)
    config = engine_config_from_args(args)
    dp = config.parallel is not None and (config.parallel.data_parallel_size > 1
                                          or config.parallel.distributed_executor_backend == "ray")
    if not dp:
        print(f"bench throughput: loading {config.model or 'the default model'}", file=sys.stderr, flush=True)
    engine = None if dp else LLMEngine(config)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes:
            if engine is None:  # data parallel: fresh engine processes per run, started before the clock
                from tokenloom.bench.dp_runs import run_on_dp_engines

                kwargs = {**engine_kwargs_from_args(args), "batching": mode}
                row, engine_info = run_on_dp_engines(engine_config_from_kwargs(args.model, **kwargs), requests,
                                                     label=f"bench throughput [{rep + 1}/{args.repeats}] {mode}")
                runs[mode].append(row)
                print(f"[{rep + 1}/{args.repeats}] {mode} on {len(row['requests_per_engine'])} engines "
                      f"{row['requests_per_engine']}: {row['duration_s']:.1f} s, "
                      f"{row['output_tok_s']:.0f} output tok/s", file=sys.stderr)
                continue
            res = run_on_engine(engine, requests, {"batching": mode},
                                label=f"bench throughput [{rep + 1}/{args.repeats}] {mode}")
            m = res.metrics
            row = {
                "duration_s": m["duration"], "requests_per_s": m["request_throughput"],
                "input_tok_s": m["input_throughput"], "output_tok_s": m["output_throughput"],
                "total_tok_s": m["total_token_throughput"], "median_ttft_ms": m["median_ttft_ms"],
                "median_e2el_ms": m["median_e2el_ms"], "p99_e2el_ms": m["p99_e2el_ms"],
                "preemptions": res.num_preemptions, "steps": res.num_steps, "failed": m["failed"],
            }  # fmt: skip
            runs[mode].append(row)
            print(f"[{rep + 1}/{args.repeats}] {mode}: {row['duration_s']:.1f} s, "
                  f"{row['output_tok_s']:.0f} output tok/s", file=sys.stderr)
    summary = {mode: {k: (statistics.median(r[k] for r in rows) if rows[0][k] is not None else None)
                      for k in rows[0] if k != "requests_per_engine"}
               for mode, rows in runs.items()}  # fmt: skip
    if engine is None:
        engine = engine_info
    print(format_throughput_table(summary, engine))
    if args.result_file:
        info = {"model": engine.model_name, "dtype": str(engine.dtype).replace("torch.", ""),
                "quantization": engine.config.quantization,
                "data_parallel_size": config.parallel.data_parallel_size if config.parallel else 1,
                "num_requests": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests),
                "output_tokens": sum(r.max_tokens for r in requests), "repeats": args.repeats}  # fmt: skip
        with open(args.result_file, "w") as f:
            json.dump({"config": info, "median": summary, "runs": runs}, f, indent=1)
    return 0


def format_throughput_table(summary: dict[str, dict[str, float]], engine: Any) -> str:
    head = ["mode", "time s", "req/s", "in tok/s", "out tok/s", "total tok/s", "TTFT p50 ms", "E2E p50 ms",
            "preempt", "steps"]  # fmt: skip
    keys = ["duration_s", "requests_per_s", "input_tok_s", "output_tok_s", "total_tok_s", "median_ttft_ms",
            "median_e2el_ms", "preemptions", "steps"]  # fmt: skip
    rows = [[mode] + [f"{s[k]:.1f}" if isinstance(s[k], float) else "-" if s[k] is None else str(s[k]) for k in keys]
            for mode, s in summary.items()]  # fmt: skip
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
    quant = f" + {engine.config.quantization} layers" if getattr(engine.config, "quantization", None) else ""
    title = f"{engine.model_name}, {str(engine.dtype).replace('torch.', '')}{quant} on {engine.device}"
    return "\n".join([title, fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])
