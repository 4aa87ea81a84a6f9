"""`tokenloom profile`: time the real ModelRunner on a grid of step shapes and fit the cost model.

Steps are built by hand (no scheduler): each shape is a list of rows (start, n, samples). Decode rows
are persistent requests that go through the runner's cached path, as in a real decode batch (the
first, untimed call registers them); prefill rows are fresh requests every call, as a newly admitted
prompt is. Block ids are fake but distinct, from a pool sized for the largest shape, so attention
reads as much memory as it would for real. Each shape: warm-up calls, then the median of repeats; the
grid is run in several passes and each shape keeps its median pass; before each shape the profiler
waits for the machine to be quiet (quiet.py).
"""

from __future__ import annotations

import datetime as _dt
import itertools
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.cost_model import CostModel, StepShape
from tokenloom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.cost_fit import Sample, fit
from tokenloom.sim.profile import Profile, runner_fingerprint, tokenloom_version
from tokenloom.sim.quiet import wait_for_quiet
from tokenloom.sim.runner import SimulatedRunner
from tokenloom.workload.clock import VirtualClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    start: int  # tokens already computed
    n: int  # tokens this step
    samples: bool = True  # does the row reach its sequence's end (and sample)?

    @property
    def length(self) -> int:
        """The sequence length that makes the row sample (or not) by the runner's rule."""
        return self.start + self.n + (0 if self.samples else 1)


@dataclass
class Grid:
    """Prefill chunk sizes × start positions, decode batch sizes × contexts, and mixes of both.

    Small decode batches are dense on purpose: at moderate load most steps are a handful of decodes,
    where the fixed cost dominates and a straight line through large batches alone misses by 20 %.
    """

    prefill_chunks: tuple[int, ...] = (16, 64, 192, 512)
    prefill_starts: tuple[int, ...] = (0, 384)
    multi_prefill: tuple[int, ...] = (2, 4)  # several prompts of 96 tokens in one step
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (64, 512)
    long_decode: tuple[int, int] = (16, 1536)  # (batch, context): the decode attention's slope
    mixed_decodes: tuple[int, ...] = (4, 16, 48)
    mixed_chunks: tuple[int, ...] = (32, 256)
    mixed_context: int = 256

    def shapes(self) -> list[list[Row]]:
        out: list[list[Row]] = []
        for n, s in itertools.product(self.prefill_chunks, self.prefill_starts):
            out.append([Row(s, n, samples=s == 0)])  # a first chunk that samples, a middle one that does not
        for k in self.multi_prefill:
            out.append([Row(0, 96)] * k)
        for d, c in itertools.product(self.decode_batches, self.decode_contexts):
            out.append([Row(c - 1, 1)] * d)
        b, c = self.long_decode
        out.append([Row(c - 1, 1)] * b)
        for d, n in itertools.product(self.mixed_decodes, self.mixed_chunks):
            out.append([Row(self.mixed_context - 1, 1)] * d + [Row(0, n)])
        return out


QUICK_GRID = Grid(prefill_chunks=(8, 32), prefill_starts=(0, 16), multi_prefill=(2,), decode_batches=(1, 4),
                  decode_contexts=(8, 32), long_decode=(2, 64), mixed_decodes=(2,), mixed_chunks=(8,),
                  mixed_context=16)  # fmt: skip


@dataclass
class _Live:
    """Requests the runner currently holds for this shape."""

    decodes: list[tuple[str, int]] = field(default_factory=list)  # (req_id, num_computed_tokens)
    prefills: list[str] = field(default_factory=list)


class StepDriver:
    """Feeds hand-built SchedulerOutputs to a runner and times execute_model."""

    def __init__(self, runner: Any, block_size: int, vocab_size: int, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.ids = itertools.count()
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        self.live = _Live()
        self.next_block = 0
        self.prefill_block_mark = 0  # prefill rows take blocks from here on; the decodes' are below

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return blocks

    def _new(self, row: Row, extra_tokens: int = 0) -> NewRequestData:
        req_id = f"p{next(self.ids)}"
        tokens = self.rng.integers(1, self.vocab_size, size=row.length).tolist()
        return NewRequestData(req_id, tokens, tokens, self.params, (self._blocks(row.length + extra_tokens),),
                              row.start)

    def begin(self, rows: Sequence[Row], repeats: int) -> SchedulerOutput:
        """The shape's first call: everything new. Decodes get blocks for the calls to come."""
        finished = {rid for rid, _ in self.live.decodes} | set(self.live.prefills)
        self.next_block = 0
        decode_rows = [r for r in rows if r.n == 1]
        prefill_rows = [r for r in rows if r.n > 1]
        decodes = [self._new(r, extra_tokens=repeats + 1) for r in decode_rows]
        self.prefill_block_mark = self.next_block
        prefills = [self._new(r) for r in prefill_rows]
        self.live = _Live(
            decodes=[(nr.req_id, r.start + 1) for nr, r in zip(decodes, decode_rows)],
            prefills=[nr.req_id for nr in prefills],
        )
        new = decodes + prefills
        scheduled = {nr.req_id: r.n for nr, r in zip(new, decode_rows + prefill_rows)}
        return _output(new, CachedRequestData(), scheduled, finished)

    def again(self, rows: Sequence[Row]) -> tuple[SchedulerOutput, StepShape]:
        """A further call: the decodes advance one token (cached path), the prefills are fresh prompts."""
        finished = set(self.live.prefills)
        self.next_block = self.prefill_block_mark  # reuse the prefills' blocks: their owners are gone
        prefill_rows = [r for r in rows if r.n > 1]
        new = [self._new(r) for r in prefill_rows]
        cached = CachedRequestData(
            req_ids=[rid for rid, _ in self.live.decodes],
            new_block_ids=[([],) for _ in self.live.decodes],
            num_computed_tokens=[c for _, c in self.live.decodes],
        )
        scheduled = {rid: 1 for rid, _ in self.live.decodes} | {nr.req_id: r.n for nr, r in zip(new, prefill_rows)}
        shape = StepShape.of_rows(
            [(c, 1, True) for _, c in self.live.decodes] + [(r.start, r.n, r.samples) for r in prefill_rows]
        )
        self.live = _Live(decodes=[(rid, c + 1) for rid, c in self.live.decodes], prefills=[nr.req_id for nr in new])
        return _output(new, cached, scheduled, finished), shape

    def time_shape(self, rows: Sequence[Row], warmup: int, repeats: int) -> Sample:
        self.runner.execute_model(self.begin(rows, warmup + repeats))
        times: list[float] = []
        shapes: list[StepShape] = []
        for i in range(warmup + repeats):
            output, shape = self.again(rows)
            t0 = time.perf_counter()
            self.runner.execute_model(output)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                shapes.append(shape)
        # The decodes' context grows one token per call: the middle call's shape goes with the median.
        return Sample(shapes[len(shapes) // 2], statistics.median(times))


def _output(
    new: list[NewRequestData], cached: CachedRequestData, scheduled: dict[str, int], finished: set[str]
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=finished,
    )


def blocks_needed(grid: Grid, block_size: int, slack: int) -> int:
    """The pool for the largest shape (decodes hold blocks for `slack` more tokens)."""
    per_shape = []
    for rows in grid.shapes():
        per_shape.append(sum(-(-(r.length + (slack if r.n == 1 else 0)) // block_size) for r in rows))
    return max(per_shape)


def scheduler_overhead(
    block_size: int, batch_sizes: Sequence[int] = (1, 16, 64, 128), steps: int = 40
) -> dict[str, float]:
    """Seconds the real Scheduler spends per step (schedule + update_from_output) around the runner,
    as overhead + per-request cost, from decode batches of several sizes (the runner here costs nothing
    and is not timed)."""
    sizes, medians = [], []
    for d in batch_sizes:
        clock = VirtualClock()
        max_len = 64 + steps + 16
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=max(2048, d), max_num_seqs=d, max_model_len=max_len),
            CacheConfig(block_size=block_size, num_blocks=d * (-(-max_len // block_size)) + 1),
            clock=clock,
        )
        runner = SimulatedRunner(CostModel({}), clock)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(d):
            scheduler.add_request(Request(f"r{i}", [17 + i % 1000] * 64, params, arrival_time=float(i)))
        scheduler.update_from_output(out := scheduler.schedule(), runner.execute_model(out))  # the prefills
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = scheduler.schedule()
            t1 = time.perf_counter()
            runner_output = runner.execute_model(out)
            t2 = time.perf_counter()
            scheduler.update_from_output(out, runner_output)
            times.append((t1 - t0) + (time.perf_counter() - t2))
        sizes.append(d)
        medians.append(statistics.median(times))
    per_seq, fixed = np.polyfit(sizes, medians, 1)
    return {"overhead": max(float(fixed), 0.0), "num_seqs": max(float(per_seq), 0.0)}


# The CPU feature flags that pick the runner's kernels (float32 or bf16, VNNI or maddubs int8 dots, AMX), so
# step times of one profile hold only where they are the same.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")
# What makes two machines the same hardware for a profile. A VM often shows a masked model name ("AMD
# EPYC" on a Zen 4 and a Zen 5 alike, whose prefill steps are 2x apart), so the family and model numbers
# and the kernel flags count beside it.
HARDWARE_IDENTITY_KEYS = ("cpu", "cpu_family", "cpu_model", "isa", "cores")


def _cpuinfo_first_processor() -> dict[str, str]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends at its blank line
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def hardware_info(device: str) -> dict[str, Any]:
    import torch

    from tokenloom import cpu_isa

    fields = _cpuinfo_first_processor()
    flags = cpu_isa.cpu_flags()  # as TOKENLOOM_CPU_ISA caps them: the kernels a profile measured
    info: dict[str, Any] = {
        "cpu": fields.get("model name", platform.processor() or platform.machine()),
        "cpu_family": fields.get("cpu family", ""),
        "cpu_model": fields.get("model", ""),
        "isa": [f for f in KERNEL_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def hardware_mismatch(profiled: dict[str, Any], here: dict[str, Any]) -> str | None:
    """Why a profile measured on `profiled` does not describe `here` (both `hardware_info` dicts), or None
    when it does. A profile that does not record one of the identity keys (made before they were
    recorded) cannot be matched: its CPU is unknown."""
    for key in HARDWARE_IDENTITY_KEYS:
        if key not in profiled:
            return f"the profile does not record the CPU's {key!r}: re-profile to compare"
        if profiled[key] != here.get(key):
            return f"{key}: profiled on {profiled[key]!r}, this machine has {here.get(key)!r}"
    return None


def time_grid(
    runner: Any,
    vocab_size: int,
    grid: Grid,
    warmup: int,
    repeats: int,
    passes: int,
    max_wait_s: float,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Sample], int]:
    """Each grid shape timed on `runner` (its pool must hold blocks_needed()), and how many shapes were
    timed while the machine stayed busy.

    A shape is timed once the machine is quiet (or after max_wait_s anyway, counted as noisy), in several
    passes over the grid; each shape keeps its median pass. Not the fastest: on a shared VM the same
    step drifts by ~10 % over minutes (memory bandwidth, neighbours), and a model of best cases was
    10-17 % optimistic on the real engine's steps. The median is what a run of many steps sees.
    """
    driver = StepDriver(runner, runner.block_size, vocab_size)
    shapes = grid.shapes()
    timed: list[list[Sample]] = [[] for _ in shapes]
    noisy = 0
    rng = np.random.default_rng(0)
    for p in range(passes):
        # A new order each pass, so that no shape always runs right after the same neighbour.
        order = list(range(len(shapes))) if p == 0 else [int(i) for i in rng.permutation(len(shapes))]
        for k, i in enumerate(order):
            quiet = wait_for_quiet(max_wait_s, on_busy=_busy_note(progress, max_wait_s)) if max_wait_s > 0 else True
            noisy += not quiet
            sample = driver.time_shape(shapes[i], warmup, repeats)
            timed[i].append(sample)
            if progress:
                s = sample.shape
                progress(f"pass {p + 1}/{passes} [{k + 1}/{len(shapes)}] prefill {s.prefill_tokens:4d} tok, "
                         f"{s.decode_tokens:3d} decodes (ctx {s.decode_max_context:4d}), {s.num_seqs:3d} seqs: "
                         f"{sample.seconds * 1e3:8.2f} ms" + ("" if quiet else "  (machine busy)"))  # fmt: skip
    return [sorted(samples, key=lambda x: x.seconds)[(len(samples) - 1) // 2] for samples in timed if samples], noisy


def _busy_note(progress: Callable[[str], None] | None, max_wait_s: float) -> Callable[[float], None] | None:
    """A progress line before a wait for the CPU (up to --max-wait seconds), so a busy machine is not
    mistaken for a hung profile."""
    if progress is None:
        return None
    return lambda busy: progress(f"the CPUs are {busy:.0%} busy with other work: waiting up to {max_wait_s:g} s "
                                 f"for them to quiet before timing the next shape (--max-wait)")


def run_profile(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    quantization: str | None = None,
    block_size: int = 16,
    grid: Grid | None = None,
    warmup: int = 2,
    repeats: int = 5,
    passes: int = 3,
    max_wait_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
    hf_overrides: dict[str, Any] | None = None,
    disable_sliding_window: bool = False,
) -> Profile:
    """Load the model, time every shape of the grid, fit, and return the profile. `hf_overrides` and
    `disable_sliding_window`: the engine's (a profile of the model the engine would run)."""
    from tokenloom.config import auto_kv_cache_dtype
    from tokenloom.model.hf_overrides import ModelOverrides
    from tokenloom.model.loader import checkpoint_float_dtype, load_model, resolve_hf_overrides, resolve_model_path
    from tokenloom.model.platform import resolve_device, resolve_dtype
    from tokenloom.model.runner import ModelRunner

    grid = grid or Grid()
    # Taken before anything is timed: if the runner's code changes meanwhile, the profile reads as stale.
    fingerprint = runner_fingerprint()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path = resolve_model_path(model)
    overrides = ModelOverrides.of(resolve_hf_overrides(hf_overrides, path), disable_sliding_window)
    loaded = load_model(path, torch_dtype, overrides=overrides)
    num_blocks = blocks_needed(grid, block_size, warmup + repeats + 1)
    # int8 layers run at the same speed smoothed or not: no calibration needed to time them.
    # The cache the engine's --kv-cache-dtype auto would store (a 16-bit one for a float32 run of a 16-bit model).
    kv_cache_dtype = auto_kv_cache_dtype("auto", str(dtype), str(torch_dtype).removeprefix("torch."),
                                         checkpoint_float_dtype(path))
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=num_blocks, dtype=torch_dtype, device=dev,
                         quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    name = "SmolLM2-135M-Instruct" if model in (None, "default") else (loaded.config.name or path.stem)
    return profile_runner(runner, loaded.config, name, quantization=quantization, grid=grid, warmup=warmup,
                          repeats=repeats, passes=passes, max_wait_s=max_wait_s, progress=progress,
                          fingerprint=fingerprint)  # fmt: skip


def profile_runner(
    runner: Any,
    model_config: Any,
    name: str,
    *,
    quantization: str | None = None,
    grid: Grid | None = None,
    warmup: int = 2,
    repeats: int = 5,
    passes: int = 3,
    max_wait_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
    fingerprint: str | None = None,
) -> Profile:
    """Time every shape of the grid on a loaded runner, fit, and return the profile.

    The runner may be an engine's own (benchmarks that compare the real engine with the simulator
    calibrate the very runner they then measure): its KV pool must hold the grid's largest shape, and
    the runner's per-request state is left to the caller to clear (EngineCore's executor.reset())."""
    from tokenloom.model.attention import kv_cache_bytes_per_block

    grid = grid or Grid()
    fingerprint = fingerprint or runner_fingerprint()
    need = blocks_needed(grid, runner.block_size, warmup + repeats + 1)
    if runner.num_blocks < need:
        raise ValueError(f"profiling this grid needs {need} KV blocks; the runner has {runner.num_blocks}")
    t0 = time.perf_counter()
    samples, noisy = time_grid(runner, model_config.vocab_size, grid, warmup, repeats, passes, max_wait_s, progress)
    cost_model, error = fit(samples)
    if progress and runner_fingerprint() != fingerprint:
        progress("warning: the runner's code changed while profiling; the profile is marked stale")
    if max_wait_s > 0:
        wait_for_quiet(max_wait_s)
    overhead = scheduler_overhead(runner.block_size)
    hardware = hardware_info(str(runner.device))
    hardware["shapes_timed_while_busy"] = noisy
    dtype_name = str(runner.dtype).replace("torch.", "")
    logger.info("profiled %d shapes in %.1f s", len(samples), time.perf_counter() - t0)
    return Profile(
        model=name,
        dtype=dtype_name,
        quantization=quantization,
        block_size=runner.block_size,
        hardware=hardware,
        cost_model=cost_model,
        fit=error,
        samples=samples,
        scheduler_overhead=overhead,
        max_model_len=model_config.context_length,
        kv_bytes_per_token=kv_cache_bytes_per_block(model_config, 1, runner.dtype),
        kv_head_dim=model_config.head_dim,
        kv_cache_dtype=getattr(runner, "kv_cache_dtype", "auto"),
        runner_fingerprint=fingerprint,
        created=_dt.datetime.now().isoformat(timespec="seconds"),
        tokenloom_version=tokenloom_version(),
    )
