"""Simulator accuracy: the same trace through the real engine and through the simulator.

The real side is EngineCore + ModelRunner with a wall clock; the simulated side is EngineCore +
SimulatedRunner with a virtual clock and the profile's cost model. Both are driven by the same loop
(tokenloom.workload.driver.run_workload): same arrivals, same scheduler and KV pool, same output lengths
(ignore_eos). Prints TTFT / TPOT / ITL / E2E at p50 and p99 and output throughput, real vs simulated,
and how well the cost model predicts each real step's execute time.

    .venv/bin/python benchmarks/scheduler/sim_accuracy.py \
        --profile tokenloom/sim/profiles/smollm2-135m-instruct-cpu.json
    .venv/bin/python benchmarks/scheduler/sim_accuracy.py --max-num-seqs 8 --max-num-batched-tokens 256 --rate 2

Run it on a quiet machine: two cores shared with anything else slow the real engine down many times
over (torch's threads wait on each other), and the comparison then measures the neighbours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from tokenloom.core.scheduler_factory import make_scheduler  # noqa: E402
from tokenloom.engine.core import EngineCore  # noqa: E402
from tokenloom.engine.executor import UniProcExecutor  # noqa: E402
from tokenloom.engine.trace import StepTracer  # noqa: E402
from tokenloom.sim.cost_fit import Sample, fit, fit_error  # noqa: E402
from tokenloom.sim.profile import Profile, load_profile, runner_fingerprint  # noqa: E402
from tokenloom.sim.profiler import Grid, Row, StepDriver, scheduler_overhead, time_grid  # noqa: E402
from tokenloom.sim.quiet import cpu_times, wait_for_quiet  # noqa: E402
from tokenloom.sim.runner import SequenceTracker  # noqa: E402
from tokenloom.sim.simulate import engine_configs, simulate  # noqa: E402
from tokenloom.workload.clock import WallClock  # noqa: E402
from tokenloom.workload.datasets import BenchRequest, assign_arrivals, random_requests  # noqa: E402
from tokenloom.workload.driver import WorkloadResult, run_workload  # noqa: E402

CONTAMINATED = 0.1  # other processes' share of the CPUs above which the real figures mean little
ROWS = [
    ("TTFT p50 (ms)", "median_ttft_ms"), ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT p50 (ms)", "median_tpot_ms"), ("TPOT p99 (ms)", "p99_tpot_ms"),
    ("ITL p50 (ms)", "median_itl_ms"), ("ITL p99 (ms)", "p99_itl_ms"),
    ("E2E p50 (ms)", "median_e2el_ms"), ("E2E p99 (ms)", "p99_e2el_ms"),
    ("output tok/s", "output_throughput"), ("duration (s)", "duration"),
]  # fmt: skip


@dataclass
class ShapeRecorder:
    """Wraps the real runner: the shape of every step (as the simulator sees it) and its execute time."""

    runner: Any
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    samples: list[Sample] = field(default_factory=list)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        shape, _ = self.tracker.step(so)
        out = self.runner.execute_model(so)
        if so.num_scheduled_tokens:
            self.samples.append(Sample(shape, out.execute_time or 0.0))
        return out


@dataclass
class StepTimes:
    """EngineCore's tracer hook: each whole step's duration (schedule + execute + update), and the
    step trace file when asked for."""

    file: StepTracer | None = None
    seconds: list[float] = field(default_factory=list)

    def record(self, t_start: float, t_end: float, *rest: Any) -> None:
        self.seconds.append(t_end - t_start)
        if self.file is not None:
            self.file.record(t_start, t_end, *rest)


def workload(args: argparse.Namespace) -> list[BenchRequest]:
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, seed=args.seed)
    return assign_arrivals(reqs, args.rate, 1.0, args.seed)


def warm_up(runner: Any, sched: Any, cache: Any, args: argparse.Namespace) -> None:
    """Requests like the measured ones (another seed), all at once, before measuring: a fresh runner
    pays one-off costs (oneDNN sets up a GEMM the first time it sees a batch size), which a server that
    has been up for a while has paid already, and which the profile's warm-up calls leave out too."""
    core = EngineCore(make_scheduler(sched, cache), UniProcExecutor(runner))
    reqs = random_requests(args.warmup_prompts, args.input_len, args.output_len, args.range_ratio, seed=args.seed + 1)
    run_workload(reqs, core, WallClock())


def load_runner(args: argparse.Namespace, profile: Any, sched: Any, cache: Any) -> Any:
    from tokenloom.model.loader import load_model, resolve_model_path
    from tokenloom.model.runner import ModelRunner

    loaded = load_model(resolve_model_path(args.model), _torch_dtype(profile.dtype))
    # The profile's layers: int8 ones when it was measured with --quantization int8 (unsmoothed here:
    # smoothing changes no step time).
    runner = ModelRunner(loaded, block_size=cache.block_size, num_blocks=cache.num_blocks, dtype=profile.dtype,
                         device="cpu", quantization=profile.quantization)  # fmt: skip
    warm_up(runner, sched, cache, args)
    return runner


@dataclass
class RealRun:
    result: WorkloadResult
    recorder: ShapeRecorder
    step_seconds: list[float]
    others_cpu_share: float | None  # of all CPUs, by other processes, during the run


def run_real(runner: Any, requests: list[BenchRequest], sched: Any, cache: Any, trace_path: str | None,
             seed: int) -> RealRun:  # fmt: skip
    recorder = ShapeRecorder(runner)
    clock = WallClock()
    times = StepTimes(StepTracer(trace_path) if trace_path else None)
    core = EngineCore(make_scheduler(sched, cache, clock=clock), UniProcExecutor(recorder), times)  # type: ignore[arg-type]
    cpu0, own0 = cpu_times(), time.process_time()
    try:
        result = run_workload(requests, core, clock, seed=seed)
    finally:
        if times.file is not None:
            times.file.close()
    others = _others_share(cpu0, cpu_times(), time.process_time() - own0)
    return RealRun(result, recorder, times.seconds, others)


def refit(runner: Any, profile: Profile, args: argparse.Namespace) -> Profile:
    """Profile this very runner (same code, same KV pool) in this process, as `tokenloom profile` does."""
    samples, noisy = time_grid(runner, runner.vocab_size, Grid(), 2, 5, args.refit_passes, args.max_wait)
    cost_model, error = fit(samples)
    print(f"refit on this runner: {len(samples)} shapes ({noisy} timed while busy), MAPE {error.mape:.1%}, "
          f"worst {error.max_ape:.1%}, R² {error.r2:.4f}", file=sys.stderr)  # fmt: skip
    return replace(profile, cost_model=cost_model, fit=error, samples=samples, runner_fingerprint=runner_fingerprint(),
                   scheduler_overhead=scheduler_overhead(runner.block_size))  # fmt: skip


PROBE = [Row(255, 1)] * 8  # one fixed decode step, timed before and after the real run


def probe(runner: Any, profile: Profile) -> float:
    """The machine's speed now relative to the profile: measured / predicted seconds of a fixed step.

    On a shared VM the same step's time drifts by tens of percent over minutes; the simulator cannot be
    more accurate than that, and this says how much of an error is the machine's, not the model's."""
    sample = StepDriver(runner, runner.block_size, runner.vocab_size).time_shape(PROBE, 3, 15)
    return sample.seconds / profile.cost_model.predict(sample.shape)


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def pct_error(sim: float | None, real: float | None) -> str:
    if sim is None or real is None or real == 0:
        return "n/a"
    return f"{(sim - real) / real * 100:+.1f}%"


def table(real: dict[str, Any], sim: dict[str, Any]) -> str:
    lines = ["| metric | real engine | simulator | error |", "|---|---:|---:|---:|"]
    for label, key in ROWS:
        r, s = real.get(key), sim.get(key)
        fmt = (lambda v: "n/a" if v is None else f"{v:.1f}") if key != "duration" else (lambda v: f"{v:.2f}")
        lines.append(f"| {label} | {fmt(r)} | {fmt(s)} | {pct_error(s, r)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="default")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (must match the profile)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--range-ratio", type=float, default=0.75)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s (inf: all at t=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-prompts", type=int, default=32, help="requests run (untimed) before the measured run")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--trace-prefix", default=None, help="write PREFIX.real.jsonl and PREFIX.sim.jsonl step traces")
    p.add_argument("--out", default=None, help="write both results and the table as JSON")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for a quiet machine first")
    p.add_argument("--attempts", type=int, default=3, help="real runs until one is not contaminated by other work")
    p.add_argument("--refit", action="store_true",
                   help="profile the engine's own runner in this process first (same code and pool) and use that")
    p.add_argument("--refit-passes", type=int, default=3)
    args = p.parse_args(argv)

    profile = load_profile(args.profile)
    if profile.is_stale() and not args.refit:
        print("warning: the runner's code changed since the profile was measured; expect larger errors (or --refit)",
              file=sys.stderr)  # fmt: skip
    kwargs = {k: getattr(args, k) for k in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                                            "num_blocks") if getattr(args, k) is not None}  # fmt: skip
    sched, cache = engine_configs(profile, kwargs)
    requests = workload(args)
    print(f"{len(requests)} requests over {requests[-1].arrival_s:.1f} s; max_num_seqs {sched.max_num_seqs}, "
          f"max_num_batched_tokens {sched.max_num_batched_tokens}, {cache.num_blocks} blocks", file=sys.stderr)

    runner = load_runner(args, profile, sched, cache)
    if args.refit:
        profile = refit(runner, profile, args)
    trace_path = args.trace_prefix + ".real.jsonl" if args.trace_prefix else None
    for attempt in range(1, args.attempts + 1):
        wait_for_quiet(args.max_wait)
        speed_before = probe(runner, profile)
        run = run_real(runner, requests, sched, cache, trace_path, args.seed)
        speed_after = probe(runner, profile)
        others = run.others_cpu_share
        if others is None or others <= CONTAMINATED:
            break
        print(f"attempt {attempt}: other processes used {others:.0%} of the CPUs during the real run"
              + ("; again" if attempt < args.attempts else ""), file=sys.stderr)  # fmt: skip
    real = run.result
    sim_trace = args.trace_prefix + ".sim.jsonl" if args.trace_prefix else None
    sim = simulate(requests, sched, cache, profile.step_model, trace=sim_trace, seed=args.seed)

    step_fit = fit_error(profile.cost_model, run.recorder.samples)
    exec_total = sum(s.seconds for s in run.recorder.samples)
    step_times = run.step_seconds
    overhead = (sum(step_times) - exec_total) / max(len(step_times), 1)
    print(table(real.metrics, sim.metrics))
    print(f"\nsteps: real {real.num_steps}, simulated {sim.num_steps}; preemptions: real {real.num_preemptions}, "
          f"simulated {sim.num_preemptions}")  # fmt: skip
    print(f"cost model on the real run's {step_fit.num_samples} steps: MAPE {step_fit.mape:.1%}, "
          f"worst {step_fit.max_ape:.1%}, R² {step_fit.r2:.3f}")  # fmt: skip
    print(f"scheduler + bookkeeping outside execute_model: {overhead * 1e3:.2f} ms per step "
          f"(median step {statistics.median(step_times) * 1e3:.1f} ms)")  # fmt: skip
    print(f"real run {real.wall_seconds:.1f} s; simulation {sim.wall_seconds:.2f} s")
    print(f"probe step (8 decodes, context 256) measured / modelled: {speed_before:.2f} before the real run, "
          f"{speed_after:.2f} after")  # fmt: skip
    if others is not None:
        print(f"other processes used {others:.0%} of the CPUs during the real run"
              + (" — the real figures are contaminated; rerun on a quiet machine" if others > CONTAMINATED else ""))
    if args.out:
        data = {
            "args": vars(args),
            "others_cpu_share_during_real_run": others,
            "profile_stale": profile.is_stale(),
            "runner_fingerprint": runner_fingerprint(),
            "real": real.metrics,
            "sim": sim.metrics,
            "errors": {key: None if math.isnan(e := _err(sim.metrics.get(key), real.metrics.get(key))) else e
                       for _, key in ROWS},  # fmt: skip
            "step_fit": vars(step_fit),
            "overhead_ms_per_step": overhead * 1e3,
            "profile_fit": vars(profile.fit),
            "requests": {r.id: {"real": [r.ttft_s, r.e2e_s], "sim": [q.ttft_s, q.e2e_s]}  # (TTFT, E2E) seconds
                         for r, q in zip(real.records, sim.records)},  # fmt: skip
            "probe_measured_over_modelled": [speed_before, speed_after],
            # Every real step: its shape (as the simulator sees it), measured and predicted execute seconds.
            "real_steps": [{**asdict(s.shape), "seconds": s.seconds, "predicted": profile.cost_model.predict(s.shape)}
                           for s in run.recorder.samples],  # fmt: skip
        }
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


def _others_share(before: tuple[int, int] | None, after: tuple[int, int] | None, own_cpu_s: float) -> float | None:
    """Share of all CPUs that other processes used between two /proc/stat readings."""
    if before is None or after is None:
        return None
    busy, idle = after[0] - before[0], after[1] - before[1]
    ticks = os.sysconf("SC_CLK_TCK")
    return max(busy / ticks - own_cpu_s, 0.0) / ((busy + idle) / ticks) if busy + idle else 0.0


def _err(sim: float | None, real: float | None) -> float:
    return (sim - real) / real if sim is not None and real else math.nan


if __name__ == "__main__":
    sys.exit(main())
