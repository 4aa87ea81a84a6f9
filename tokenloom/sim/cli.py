"""`tokenloom profile` and `tokenloom simulate`.

Imports stay inside the commands: `tokenloom --help` never pays for torch (profile) or the bench client.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.config import engine_args
from tokenloom.engine.args import add_engine_args
from tokenloom.workload.options import add_arrival_args, add_dataset_args

if TYPE_CHECKING:
    from tokenloom.config import CacheConfig, SchedulerConfig
    from tokenloom.sim.profile import Profile
    from tokenloom.workload.datasets import BenchRequest
    from tokenloom.workload.driver import WorkloadResult


def register(sub: argparse._SubParsersAction) -> None:
    _add_profile(sub)
    _add_simulate(sub)


# ---------------------------------------------------------------------------------------------- profile


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time the real model runner on a grid of step shapes and fit the cost model")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)")
    add_engine_args(p, with_model=False, only=("dtype", "device", "quantization", "block_size", "hf_overrides",
                                               "disable_sliding_window"), field_defaults=True)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per shape first")
    p.add_argument("--passes", type=int, default=3, help="passes over the grid; each shape keeps its median pass")
    p.add_argument("--max-wait", type=float, default=120.0,
                   help="seconds to wait, before each shape, for other processes to leave the CPU (0: never wait)")
    p.add_argument("--quick", action="store_true", help="a tiny grid (seconds; for tests and tiny models)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile JSON")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from tokenloom.sim.profiler import QUICK_GRID, Grid, run_profile

    print(f"profile: loading {args.model or 'the default model'}; a line per timed shape follows", file=sys.stderr,
          flush=True)

    profile = run_profile(
        args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        block_size=args.block_size,
        grid=QUICK_GRID if args.quick else Grid(), warmup=args.warmup, repeats=args.repeats, passes=args.passes,
        max_wait_s=args.max_wait,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        hf_overrides=_hf_overrides(args.hf_overrides), disable_sliding_window=args.disable_sliding_window,
    )  # fmt: skip
    profile.save(args.output)
    f = profile.fit
    print("cost model, seconds per unit (runner fit + scheduler overhead):")
    for term, coef in profile.cost_model.coefficients.items():
        extra = profile.scheduler_overhead.get(term)
        print(f"  {term:<15} {coef:.3e}" + (f" + {extra:.3e}" if extra else ""))
    print(f"fit on {f.num_samples} shapes: MAPE {f.mape:.1%}, worst {f.max_ape:.1%}, R² {f.r2:.4f}")
    print(f"wrote {args.output}")
    return 0


def _hf_overrides(value: object) -> dict:
    """--hf-overrides as the engine's config checks it (a string that is not a JSON object is refused there)."""
    from tokenloom.config import check_hf_overrides

    return check_hf_overrides(value)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------- simulate


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run a workload through the real scheduler with a calibrated cost model instead of the model",
        description="Discrete-event simulation: the same scheduler as the engine, step times from a profile. "
        "Prints the same summary as `tokenloom bench serve`; --result-file and --trace-steps write the same "
        "files as `bench serve` and the engine, so `tokenloom plot bench|timeline` read them.",
    )
    p.add_argument("--profile", default="default",
                   help="profile JSON from `tokenloom profile`, or a shipped one: default (the default model, "
                        "bf16) or int8 (the same with --quantization int8)")

    w = p.add_argument_group("workload (the names of `tokenloom bench serve`)")
    w.add_argument("--workload", default=None, metavar="W",
                   help="random | sharegpt | shared-prefix | FILE.jsonl (shorthand for --dataset-name/--dataset-path)")
    add_dataset_args(w)
    add_arrival_args(w)

    # The engine's knobs the simulator models (vLLM's names, defaults as `tokenloom serve`).
    add_engine_args(p, with_model=False, simulated=True)

    p.add_argument("--spec-acceptance", type=float, default=0.5, metavar="P",
                   help="with --speculative-config: the chance that each draft token is accepted, in order "
                        "until the first rejection (default 0.5; docs/speculative.md)")
    o = p.add_argument_group("output")
    o.add_argument("--sweep", default=None, metavar="KNOB=v1,v2,...", help="one run per value; prints a table")
    o.add_argument("--trace-steps", default=None, metavar="FILE", help="the engine's step trace (JSONL)")
    o.add_argument("--result-file", default=None, help="bench-style result JSON")
    o.add_argument("--metric-percentiles", default="50,90,95,99")
    o.add_argument("--label", default=None)
    p.set_defaults(func=_simulate)


# The engine keyword arguments a simulation takes: every knob the simulator models.
_ENGINE_KEYS = tuple(a.name for a in engine_args() if a.simulated)


def _dataset(args: argparse.Namespace) -> tuple[str, str | None]:
    """--workload W -> the bench's (--dataset-name, --dataset-path)."""
    if args.workload is None:
        return args.dataset_name, args.dataset_path
    if args.workload in ("random", "sharegpt", "jsonl", "generated-shared-prefix"):
        return args.workload, args.dataset_path
    if args.workload == "shared-prefix":
        return "generated-shared-prefix", args.dataset_path
    return "jsonl", args.workload


def _simulate(args: argparse.Namespace) -> int:
    from tokenloom.sim.profile import load_profile
    from tokenloom.workload.build import workload_from_args
    from tokenloom.workload.datasets import assign_arrivals
    from tokenloom.workload.metrics import format_summary
    from tokenloom.workload.sweep import format_table, parse_sweep, suffixed

    dataset_name, dataset_path = _dataset(args)
    profile = load_profile(args.profile)
    if profile.is_stale():
        print(f"warning: the model runner's code changed since this profile was measured ({profile.created}); "
              "its step times may be off: run `tokenloom profile` again", file=sys.stderr)
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    base_requests = workload_from_args(args, dataset_name=dataset_name, dataset_path=dataset_path,
                                       ignore_eos=True, random_prompt_format="token-ids")
    engine_kwargs = {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k) is not None}
    rate = args.request_rate
    if rate is None and dataset_name != "jsonl":
        rate = math.inf

    def one(kwargs: dict[str, Any], rate: float | None, trace: str | None, result_file: str | None) -> _Run:
        requests = base_requests
        if rate is not None:
            requests = assign_arrivals(base_requests, rate, args.burstiness, args.seed)
        run = _run_one(profile, requests, kwargs, trace, percentiles, args.seed, args.spec_acceptance)
        if result_file:
            _save_result(result_file, run, args, profile, rate, percentiles, (dataset_name, dataset_path))
        return run

    if not args.sweep:
        run = one(engine_kwargs, rate, args.trace_steps, args.result_file)
        print(format_summary(run.result.metrics, {"request_rate": _rate_json(rate)}))
        _print_sim_line(run)
        return 1 if run.result.metrics["failed"] else 0

    sweep = parse_sweep(args.sweep)
    rows = []
    dp_lines: list[str] = []
    for value, label in zip(sweep.values, sweep.labels):
        kwargs, run_rate = dict(engine_kwargs), rate
        if sweep.knob == "request_rate":
            run_rate = value
        else:
            kwargs[sweep.knob] = value
        run = one(kwargs, run_rate, suffixed(args.trace_steps, sweep.knob, label),
                  suffixed(args.result_file, sweep.knob, label))  # fmt: skip
        rows.append((label, run.result.metrics, run.result.num_preemptions, run.result.num_steps))
        print(f"{sweep.knob}={label}: {run.result.num_steps} steps in {run.result.wall_seconds:.1f} s", file=sys.stderr)
        if (dp := _dp_figures(run.result)) is not None:
            dp_lines.append(f"{sweep.knob}={label}: prefix-cache hit rate {dp['prefix_cache_hit_rate']:.3f}, "
                            f"requests per engine {dp['requests_per_engine']}")
    print(format_table(sweep.knob, rows))
    if dp_lines:
        print("\n".join(dp_lines))
    return 0


@dataclass
class _Run:
    result: WorkloadResult
    sched: SchedulerConfig
    cache: CacheConfig


def _run_one(profile: Profile, requests: list[BenchRequest], kwargs: dict[str, Any], trace: str | None,
             percentiles: list[float], seed: int, spec_acceptance: float = 0.5) -> _Run:  # fmt: skip
    from tokenloom.config import ParallelConfig, split_engine_kwargs
    from tokenloom.router import RouterConfig
    from tokenloom.sim.dp_simulate import simulate_dp
    from tokenloom.sim.simulate import engine_configs, simulate, speculative_config_of
    from tokenloom.workload.progress import Progress

    sched, cache = engine_configs(profile, kwargs)
    spec = speculative_config_of(kwargs)
    parallel = ParallelConfig(**split_engine_kwargs(kwargs)["parallel"])
    if parallel.data_parallel_size == 1:
        with Progress("simulate", len(requests)) as progress:
            result = simulate(requests, sched, cache, profile.step_model, trace=trace, percentiles=percentiles,
                              seed=seed, speculative_config=spec, spec_acceptance=spec_acceptance, progress=progress)
        return _Run(result, sched, cache)
    if trace:
        raise ValueError("--trace-steps traces one engine; it is not available with --data-parallel-size > 1")
    if spec is not None:
        raise ValueError("the data-parallel simulation does not model --speculative-config yet")
    result = simulate_dp(requests, sched, cache, profile.step_model, parallel.data_parallel_size,
                         RouterConfig.from_parallel(parallel), percentiles=percentiles, seed=seed)
    return _Run(result, sched, cache)


def _rate_json(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


def _print_sim_line(run: _Run) -> None:
    r = run.result
    sched, cache = run.sched, run.cache
    print(f"simulated {r.metrics['duration']:.1f} s of serving in {r.wall_seconds:.2f} s: {r.num_steps} steps, "
          f"{r.num_preemptions} preemptions; {cache.num_blocks} KV blocks of {cache.block_size}, "
          f"max_num_seqs {sched.max_num_seqs}, max_num_batched_tokens {sched.max_num_batched_tokens or 'auto'}")
    if (dp := _dp_figures(r)) is not None:
        print(f"data parallel: {dp['data_parallel_size']} engines ({cache.num_blocks} KV blocks each), "
              f"routing {dp['routing_policy']}: prefix-cache hit rate {dp['prefix_cache_hit_rate']:.3f}, "
              f"requests per engine {dp['requests_per_engine']}")


def _dp_figures(result: Any) -> dict[str, Any] | None:
    """The data-parallel figures of a run (None for one engine)."""
    if not hasattr(result, "requests_per_engine"):
        return None
    return {"data_parallel_size": result.num_engines, "routing_policy": result.policy,
            "prefix_cache_hit_rate": result.prefix_cache_hit_rate, "requests_per_engine": result.requests_per_engine,
            "router_decisions": result.router_decisions}  # fmt: skip


def _save_result(path: str, run: _Run, args: argparse.Namespace, profile: Profile, rate: float | None,
                 percentiles: list[float], dataset: tuple[str, str | None]) -> None:  # fmt: skip
    from tokenloom.workload.result import BenchResult

    config = {
        "model_id": profile.model,
        "label": args.label,
        "num_prompts": len(run.result.records),
        "request_rate": _rate_json(rate),
        "burstiness": args.burstiness,
        "seed": args.seed,
        "percentiles": percentiles,
        "dataset_name": dataset[0],
        "dataset_path": dataset[1],
        "simulator": {
            "profile": args.profile,
            "profile_hardware": profile.hardware,
            "scheduler_config": asdict(run.sched),
            "cache_config": asdict(run.cache),
            "num_steps": run.result.num_steps,
            "num_preemptions": run.result.num_preemptions,
            "wall_seconds": run.result.wall_seconds,
            "data_parallel": _dp_figures(run.result),
        },
    }
    data = BenchResult(config=config, records=run.result.records, metrics=run.result.metrics).to_dict()
    data["backend"] = "tokenloom-sim"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
