"""The opt-in scheduling policies on the real engine, side by side with the simulator (docs/scheduling_policies.md).

The three figures of benchmarks/scheduler/scheduling_policies.py (the simulator at scale), scaled down to what the
default model (SmolLM2-135M-Instruct; float32 on an AVX2-only 2-core CPU) serves in under a minute per
configuration, each run two ways on the same trace, with the vLLM-identical default as the first row:

- real: the real engine in this process (LLMEngine and its ModelRunner; requests enter at their arrival
  times on the wall clock: tokenloom.bench.engine_runs.run_on_engine, i.e. the driver
  tokenloom.workload.driver.run_workload, the same loop the simulator runs). Every configuration runs
  --repeats times, alternated (A, B, C, A, B, C), so the machine's drift hits all of them alike; a table
  row pools the requests of its repeats.
- sim: the simulator on the same trace, scheduler configs and KV pool, with a cost model of this runner
  on this machine: profiled first (the grid of `tokenloom profile`, on the engine's own runner, about a
  minute) unless --step-cost-profile names one. The SLO controller predicts with that same profile on
  both sides: it needs a profile of the machine it runs on, and the shipped ones are bf16 profiles of an
  AVX-512-BF16 CPU.

The workloads were sized on the simulator for a machine whose steps cost about 20 ms + 2.5 ms a token
(REFERENCE). Whether a prompt starves depends on the load relative to the machine, so with --time-scale
auto (the default) every time in a workload (arrival times, the wait bounds, the SLO targets) is divided
by how much faster than that the profiled machine is (s = REFERENCE's step time / the profile's, on
PROBE_SHAPE; clamped to [1/2, 3]): the same requests, in the same order, at the same load relative to
the machine; a machine twice as fast runs the figures in half the time, with a 250 ms bound where the
reference has 500. --time-scale 1: as sized. The tables give the values used. Before the real runs the
simulator's prediction of their total time is printed (--sim-only: that and the simulator's tables).

    # all three figures (~11 min on a quiet machine): the JSON, and the tables written into the docs
    .venv/bin/python benchmarks/scheduler/scheduling_policies_real.py --max-minutes 10 \\
        --out docs/figures/scheduling_policies_real.json --update-docs docs/scheduling_policies.md
    # the tables again from a JSON (printed, or into the docs)
    .venv/bin/python benchmarks/scheduler/scheduling_policies_real.py \
        --render docs/figures/scheduling_policies_real.json
    # the profile and the simulator only (a minute): the workloads' regime before the long run
    .venv/bin/python benchmarks/scheduler/scheduling_policies_real.py --sim-only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scheduling_policies import (  # noqa: E402
    priority_row,
    priority_workload,
    slo_row_of,
    slo_workload,
    starvation_row,
    starvation_workload,
)

from tokenloom.config import split_engine_kwargs  # noqa: E402
from tokenloom.core.cost_model import CostModel, StepShape  # noqa: E402
from tokenloom.sim.quiet import cpu_times, wait_for_quiet  # noqa: E402
from tokenloom.workload.datasets import BenchRequest, random_requests  # noqa: E402

# What the workloads were sized for (seconds per unit; see the module docstring): the simulator put each
# figure in the regime of its large-scale version on a machine this fast.
REFERENCE = CostModel({"overhead": 0.020, "prefill_tokens": 0.0025, "decode_tokens": 0.0025, "num_samples": 0.0005,
                       "decode_attn": 3e-6, "prefill_attn": 1e-6, "num_seqs": 0.0002})  # fmt: skip
# A step like the figures' busy ones (32 decodes at context 64 and a 32-token prompt chunk): how much
# faster than REFERENCE a profile is, for --time-scale auto.
PROBE_SHAPE = StepShape.of_rows([(63, 1, True)] * 32 + [(0, 32, False)])
DOCS_BEGIN = "<!-- scheduling_policies_real: begin (benchmarks/scheduler/scheduling_policies_real.py --update-docs) -->"
DOCS_END = "<!-- scheduling_policies_real: end -->"


@dataclass
class Starvation:
    """A steady decode load that leaves a long prompt little of the budget (max_num_seqs = budget)."""

    duration_s: float = 30.0
    decode_rate: float = 4.0  # chats per second
    chat_prompt: int = 16
    chat_output: tuple[int, int] = (32, 64)
    long_every_s: float = 3.0
    long_len: int = 256
    long_output: int = 16
    budget: int = 64
    bounds: list[tuple[float, int]] = field(default_factory=lambda: [(500.0, 32), (500.0, 48)])  # (ms, chunk)

    def scaled(self, s: float) -> Starvation:
        return replace(self, duration_s=self.duration_s / s, decode_rate=self.decode_rate * s,
                       long_every_s=self.long_every_s / s, bounds=[(round(ms / s), chunk) for ms, chunk in self.bounds])


@dataclass
class Priority:
    """Long low-priority requests fill max_num_seqs; short high-priority ones arrive meanwhile."""

    num_bulk: int = 24
    bulk_prompt: int = 64
    bulk_output: int = 100
    bulk_every_s: float = 0.05
    max_num_seqs: int = 8
    num_vip: int = 8
    vip_prompt: int = 32
    vip_output: int = 16
    vip_start_s: float = 2.0
    vip_every_s: float = 1.5

    def scaled(self, s: float) -> Priority:
        return replace(self, bulk_every_s=self.bulk_every_s / s, vip_start_s=self.vip_start_s / s,
                       vip_every_s=self.vip_every_s / s)  # fmt: skip


@dataclass
class Slo:
    """W2-like chats with 10 % long documents at one stable-but-busy rate; fixed budgets vs the controller."""

    duration_s: float = 45.0
    rate: float = 0.9
    chat_prompt: tuple[int, int] = (32, 192)
    chat_output: tuple[int, int] = (16, 80)
    doc_share: float = 0.1
    doc_len: int = 512
    doc_output: int = 16
    budgets: list[int] = field(default_factory=lambda: [128, 2048])
    ceiling: int = 2048
    max_num_seqs: int = 128
    target_itl_ms: float = 150.0
    target_ttft_ms: float = 3000.0
    controllers: list[str] = field(default_factory=lambda: ["itl"])  # "itl" and/or "itl+ttft"

    def scaled(self, s: float) -> Slo:
        return replace(self, duration_s=self.duration_s / s, rate=self.rate * s,
                       target_itl_ms=round(self.target_itl_ms / s), target_ttft_ms=round(self.target_ttft_ms / s))


@dataclass
class Sizes:
    starvation: Starvation = field(default_factory=Starvation)
    priority: Priority = field(default_factory=Priority)
    slo: Slo = field(default_factory=Slo)
    grid: str = "full"  # the profile's grid: full (tokenloom profile's) or quick (tiny models, tests)
    warmup_prompts: int = 12
    warmup_len: int = 256


# Seconds, not minutes: the plumbing on a tiny model (tests) or a look at the whole flow.
SMOKE = Sizes(
    starvation=Starvation(duration_s=1.0, decode_rate=12.0, chat_prompt=8, chat_output=(4, 12), long_every_s=0.5,
                          long_len=48, long_output=4, budget=16, bounds=[(20.0, 8)]),
    priority=Priority(num_bulk=6, bulk_prompt=16, bulk_output=24, max_num_seqs=2, num_vip=2, vip_prompt=8,
                      vip_output=4, vip_start_s=0.1, vip_every_s=0.2),
    slo=Slo(duration_s=1.0, rate=6.0, chat_prompt=(8, 32), chat_output=(4, 16), doc_len=64, doc_output=4,
            budgets=[32], ceiling=256, max_num_seqs=16, target_itl_ms=20.0, target_ttft_ms=200.0),
    grid="quick", warmup_prompts=4, warmup_len=32,
)  # fmt: skip


@dataclass
class Figure:
    """One figure: its trace, its configurations (scheduler overrides by field name), its row reducer."""

    name: str
    requests: list[BenchRequest]
    variants: list[tuple[str, dict[str, Any]]]
    row: Any  # (name, records, num_preemptions, num_steps) -> dict
    workload: dict[str, Any]


def figures(sizes: Sizes, scale: float, profile_path: str, vocab_size: int, seed: int,
            which: list[str]) -> list[Figure]:  # fmt: skip
    out = []
    if "starvation" in which:
        w = sizes.starvation.scaled(scale)
        reqs = starvation_workload(seed, w.duration_s, w.decode_rate, w.long_every_s, w.long_len, w.chat_prompt,
                                   w.chat_output, w.long_output)  # fmt: skip
        base = {"max_num_batched_tokens": w.budget, "max_num_seqs": w.budget}
        variants = [("default (vLLM)", base)] + [
            (f"bound {ms:g} ms, chunk {chunk}", base | {"max_prefill_wait_ms": ms, "min_prefill_chunk": chunk})
            for ms, chunk in w.bounds
        ]
        out.append(Figure("starvation", fit_vocab(reqs, vocab_size), variants,
                          lambda n, recs, _p, _s: starvation_row(n, recs), asdict(w)))  # fmt: skip
    if "priority" in which:
        w = sizes.priority.scaled(scale)
        reqs = priority_workload(seed, w.num_bulk, w.bulk_prompt, w.bulk_output, w.bulk_every_s, w.num_vip,
                                 w.vip_prompt, w.vip_output, w.vip_start_s, w.vip_every_s)  # fmt: skip
        base = {"scheduling_policy": "priority", "max_num_seqs": w.max_num_seqs}
        variants = [("priority (vLLM)", base),
                    ("priority + preemption for waiting", base | {"enable_priority_preemption": True})]
        out.append(Figure("priority_preemption", fit_vocab(reqs, vocab_size), variants,
                          lambda n, recs, p, _s: priority_row(n, recs, p), asdict(w)))  # fmt: skip
    if "slo" in which:
        w = sizes.slo.scaled(scale)
        reqs = slo_workload(seed, w.duration_s, w.rate, w.doc_share, w.doc_len, w.chat_prompt, w.chat_output,
                            w.doc_output)  # fmt: skip
        base = {"max_num_batched_tokens": w.ceiling, "max_num_seqs": w.max_num_seqs}
        variants = [(f"fixed budget {b}" + (" (vLLM default)" if b == 2048 else ""),
                     base | {"max_num_batched_tokens": b}) for b in w.budgets]  # fmt: skip
        ctl = base | {"target_itl_ms": w.target_itl_ms, "step_cost_profile": profile_path}
        for c in w.controllers:
            if c == "itl":
                variants.append((f"controller: ITL {w.target_itl_ms:g} ms", ctl))
            elif c == "itl+ttft":
                variants.append((f"controller: ITL {w.target_itl_ms:g} ms + TTFT {w.target_ttft_ms:g} ms",
                                 ctl | {"target_ttft_ms": w.target_ttft_ms}))  # fmt: skip
            else:
                raise ValueError(f"controllers: 'itl' or 'itl+ttft', got {c!r}")
        itl_s, ttft_s = w.target_itl_ms / 1000.0, w.target_ttft_ms / 1000.0
        out.append(Figure("slo_budget", fit_vocab(reqs, vocab_size), variants,
                          lambda n, recs, _p, steps: slo_row_of(n, recs, steps, itl_s, ttft_s), asdict(w)))
    return out


def fit_vocab(requests: list[BenchRequest], vocab_size: int) -> list[BenchRequest]:
    """The workloads draw token ids below 40,000; a smaller vocabulary (a tiny test model) gets them
    folded into its range (the same trace on both sides)."""
    if all(max(r.prompt) < vocab_size for r in requests if isinstance(r.prompt, list)):
        return requests
    return [replace(r, prompt=[t % vocab_size for t in r.prompt]) if isinstance(r.prompt, list) else r
            for r in requests]  # fmt: skip


# ------------------------------------------------------------------------------------------- the engine


def load_engine(args: argparse.Namespace) -> Any:
    from tokenloom.engine.llm_engine import LLMEngine

    kwargs: dict[str, Any] = {"dtype": args.dtype}
    if args.num_blocks:
        kwargs["num_blocks"] = args.num_blocks
    return LLMEngine.from_args(args.model, **kwargs)


def calibrate(engine: Any, sizes: Sizes, args: argparse.Namespace, path: Path) -> Any:
    """Profile the engine's own runner (tokenloom profile's grid), save it to `path`, return it."""
    from tokenloom.sim.profiler import QUICK_GRID, Grid, profile_runner

    name = args.model or "SmolLM2-135M-Instruct"
    t0 = time.perf_counter()
    grid = QUICK_GRID if sizes.grid == "quick" else Grid()
    profile = profile_runner(engine.runner, engine.model_config, name, grid=grid, warmup=1,
                             repeats=args.profile_repeats, passes=args.profile_passes, max_wait_s=args.max_wait)
    engine.reset_scheduler()  # the profiler's requests leave the runner
    profile.save(path)
    f = profile.fit
    log(f"profiled the engine's runner in {time.perf_counter() - t0:.0f} s: {f.num_samples} shapes, "
        f"MAPE {f.mape:.1%}, worst {f.max_ape:.1%} -> {path}")
    return profile


def warm_up(engine: Any, sizes: Sizes, seed: int) -> None:
    """Requests of many lengths at once, untimed: a fresh runner pays one-off costs the first time it sees a
    batch size, which a server that has been up a while has paid already."""
    from tokenloom.bench.engine_runs import run_on_engine

    reqs = random_requests(sizes.warmup_prompts, sizes.warmup_len, 16, 0.9, seed=seed + 1)
    run_on_engine(engine, fit_vocab(reqs, engine.model_config.vocab_size))


@dataclass
class RealRun:
    policy: str
    repeat: int
    records: list[Any]
    num_steps: int
    num_preemptions: int
    wall_s: float
    others_cpu_share: float | None
    # The SLO controller's correction at the end of the run (measured / predicted step time), if any.
    slo_correction: dict[str, Any] | None = None


def slo_correction(scheduler: Any) -> dict[str, Any] | None:
    """What the SLO controller learnt from the steps the engine measured: per part of a step, the steps
    it observed and the factors it ended with (mean: expected time; high: what one step is planned for;
    a part not warmed up borrows the other's)."""
    ctl = getattr(scheduler, "slo_budget", None)
    if ctl is None:
        return None
    c = ctl.correction
    mean, high = c.factors(high=False), c.factors(high=True)
    return {name: {"steps": r.num_observed, "mean": round(mean[i], 4), "high": round(high[i], 4)}
            for i, (name, r) in enumerate((("decode", c.decode), ("prefill", c.prefill)))}


def run_real(engine: Any, base: tuple[Any, Any], fig: Figure, name: str, overrides: dict[str, Any], repeat: int,
             seed: int) -> RealRun:  # fmt: skip
    from tokenloom.bench.engine_runs import run_on_engine

    engine.reset_scheduler(*base)  # overrides apply to the engine's own defaults, not to the last run's knobs
    cpu0, own0 = cpu_times(), time.process_time()
    res = run_on_engine(engine, fig.requests, overrides, seed=seed)
    others = others_share(cpu0, cpu_times(), time.process_time() - own0)
    return RealRun(name, repeat, res.records, res.num_steps, res.num_preemptions, res.wall_seconds, others,
                   slo_correction(engine.engine_core.scheduler))


def others_share(before: tuple[int, int] | None, after: tuple[int, int] | None, own_cpu_s: float) -> float | None:
    """Share of all CPUs that other processes used between two /proc/stat readings."""
    if before is None or after is None:
        return None
    busy, idle = after[0] - before[0], after[1] - before[1]
    ticks = os.sysconf("SC_CLK_TCK")
    return round(max(busy / ticks - own_cpu_s, 0.0) / ((busy + idle) / ticks), 3) if busy + idle else 0.0


def simulate_variant(base: tuple[Any, Any], fig: Figure, overrides: dict[str, Any], profile: Any,
                     seed: int) -> Any:  # fmt: skip
    from tokenloom.sim.simulate import simulate

    sched, cache = base
    parts = split_engine_kwargs(overrides)
    return simulate(fig.requests, replace(sched, **parts["scheduler"]), replace(cache, **parts["cache"]),
                    profile.step_model, seed=seed)  # fmt: skip


def simulate_figure(base: tuple[Any, Any], fig: Figure, profile: Any, args: argparse.Namespace) -> tuple[dict, float]:
    """The figure on the simulator, and the seconds the simulator predicts its real runs take."""
    sims = {name: simulate_variant(base, fig, ov, profile, args.seed) for name, ov in fig.variants}
    sim_rows = [fig.row(name, res.records, res.num_preemptions, res.num_steps) for name, res in sims.items()]
    predicted = args.repeats * sum(max((r.finish_s for r in res.records), default=0.0) for res in sims.values())
    log(f"{fig.name}: {len(fig.requests)} requests, {len(fig.variants)} configurations, {args.repeats} repeat(s): "
        f"{predicted / 60:.1f} min on the real engine by the simulator")
    out: dict[str, Any] = {"workload": fig.workload, "num_requests": len(fig.requests),
                           "configs": {name: ov for name, ov in fig.variants}, "sim": sim_rows}  # fmt: skip
    return out, predicted


def run_figure(engine: Any, base: tuple[Any, Any], fig: Figure, out: dict[str, Any], args: argparse.Namespace) -> None:
    """The figure's real runs, alternated; adds "real" (rows pooling the repeats) and "real_runs" to `out`."""
    runs: list[RealRun] = []
    for rep in range(args.repeats):  # A, B, C, A, B, C: drift hits every configuration alike
        for name, ov in fig.variants:
            if args.max_wait > 0:
                wait_for_quiet(args.max_wait)
            run = run_real(engine, base, fig, name, ov, rep, args.seed)
            runs.append(run)
            log(f"  {fig.name} [{rep + 1}/{args.repeats}] {name}: {run.wall_s:.1f} s, {run.num_steps} steps, "
                f"others' CPU share {run.others_cpu_share}"
                + (f", SLO correction {run.slo_correction}" if run.slo_correction else ""))
    real_rows = []
    for name, _ in fig.variants:
        mine = [r for r in runs if r.policy == name]
        records = [rec for r in mine for rec in r.records]
        row = fig.row(name, records, round(sum(r.num_preemptions for r in mine) / len(mine), 1),
                      round(sum(r.num_steps for r in mine) / len(mine)))  # fmt: skip
        row["repeats"] = [fig.row(name, r.records, r.num_preemptions, r.num_steps) for r in mine]
        real_rows.append(row)
    out["real"] = real_rows
    out["real_runs"] = [{"policy": r.policy, "repeat": r.repeat, "wall_s": round(r.wall_s, 2), "steps": r.num_steps,
                         "preemptions": r.num_preemptions, "others_cpu_share": r.others_cpu_share}
                        | ({"slo_correction": r.slo_correction} if r.slo_correction else {}) for r in runs]


def with_settings(sizes: Sizes, settings: list[str]) -> Sizes:
    """`--set FIGURE.FIELD=JSON` (e.g. slo.rate=1.2, 'slo.controllers=["itl", "itl+ttft"]',
    starvation.bounds=[[500,32]]): one workload parameter changed, by its dataclass field's name."""
    for item in settings:
        key, sep, raw = item.partition("=")
        part, _, name = key.strip().partition(".")
        figure = getattr(sizes, part, None) if part in ("starvation", "priority", "slo") else None
        if not sep or figure is None or name not in {f.name for f in fields(figure)}:
            known = ", ".join(f"{k}.{f.name}" for k in ("starvation", "priority", "slo")
                              for f in fields(getattr(sizes, k)))  # fmt: skip
            raise ValueError(f"--set {item!r}: expected FIGURE.FIELD=VALUE with one of {known}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--set {item!r}: the value must be JSON ({exc.msg})") from None
        sizes = replace(sizes, **{part: replace(figure, **{name: value})})
    return sizes


# ----------------------------------------------------------------------------------------------- tables


def _ms(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _pair(row: dict | None, a: str, b: str) -> str:
    return "—" if row is None else f"{_ms(row.get(a))} / {_ms(row.get(b))}"


def _one(row: dict | None, key: str, fmt: Any = _ms) -> str:
    return "—" if row is None else fmt(row.get(key))


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} %"


def render(data: dict[str, Any]) -> str:
    """The markdown tables (simulator and real engine side by side) of a result JSON."""
    m = data["machine"]
    lines = [f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch threads), "
             f"{m['model']} in {m['dtype']}; profile of this runner: MAPE {m['profile_mape']:.1%} over "
             f"{m['profile_shapes']} shapes; workload times / {m['time_scale']:.2f} (`--time-scale`). Real rows "
             f"pool {data['args']['repeats']} alternated run(s) per configuration; other processes' share of "
             f"the CPUs during the real runs: at most {_share(data)}. Total "
             f"{data['total_wall_s'] / 60:.1f} min.", ""]  # fmt: skip
    if "starvation" in data:
        f, w = data["starvation"], data["starvation"]["workload"]
        lo, hi = w["chat_output"]
        lines += [f"**Starvation** ({f['num_requests']} requests: {w['decode_rate']:.2f} chats/s of "
                  f"{w['chat_prompt']}-token prompts and {lo}–{hi} output tokens, a {w['long_len']}-token prompt "
                  f"every {w['long_every_s']:.2f} s, {w['duration_s']:g} s of arrivals; budget = max_num_seqs = "
                  f"{w['budget']}):", "",
                  "| policy | long prompts' TTFT p50 / p99 ms: simulator | real engine "
                  "| decodes' ITL p50 / p99 ms: simulator | real engine |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        ttft, itl = ("long_prompt_ttft_p50_ms", "long_prompt_ttft_p99_ms"), ("decode_itl_p50_ms", "decode_itl_p99_ms")
        for sim, real in _rows(f):
            lines.append(f"| {sim['policy']} | {_pair(sim, *ttft)} | {_pair(real, *ttft)} | {_pair(sim, *itl)} | "
                         f"{_pair(real, *itl)} |")
        lines.append("")
    if "priority_preemption" in data:
        f, w = data["priority_preemption"], data["priority_preemption"]["workload"]
        lines += [f"**Priority preemption** ({w['num_bulk']} low-priority requests of {w['bulk_prompt']} + "
                  f"{w['bulk_output']} tokens fill max_num_seqs={w['max_num_seqs']}, then {w['num_vip']} "
                  f"high-priority ones of {w['vip_prompt']} + {w['vip_output']} tokens arrive "
                  f"{w['vip_every_s']:.2f} s apart):", "",
                  "| policy | high-priority TTFT p50 / p99 ms: simulator | real engine "
                  "| low-priority E2E p50 ms: simulator | real engine | preemptions: simulator | real (per run) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        ttft, e2e = ("high_priority_ttft_p50_ms", "high_priority_ttft_p99_ms"), "low_priority_e2e_p50_ms"
        for sim, real in _rows(f):
            lines.append(f"| {sim['policy']} | {_pair(sim, *ttft)} | {_pair(real, *ttft)} | {_one(sim, e2e)} | "
                         f"{_one(real, e2e)} | {_one(sim, 'num_preemptions', str)} | "
                         f"{_one(real, 'num_preemptions', str)} |")
        lines.append("")
    if "slo_budget" in data:
        f, w = data["slo_budget"], data["slo_budget"]["workload"]
        (plo, phi), (olo, ohi) = w["chat_prompt"], w["chat_output"]
        lines += [f"**SLO token budget** ({f['num_requests']} requests at {w['rate']:.2f} req/s for "
                  f"{w['duration_s']:g} s: chats of {plo}–{phi} prompt and {olo}–{ohi} output tokens, "
                  f"{w['doc_share']:.0%} {w['doc_len']}-token documents; targets ITL {w['target_itl_ms']:g} ms "
                  f"(every gap), TTFT {w['target_ttft_ms']:g} ms):", "",
                  "| budget | ITL p99 ms: sim | real | TTFT p50 / p99 ms: sim | real | meets both: sim | real "
                  "| meets TTFT + TPOT: sim | real |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        ttft, both, tpot = ("ttft_p50_ms", "ttft_p99_ms"), "meets_both_pct", "meets_tpot_and_ttft_pct"
        for sim, real in _rows(f):
            lines.append(f"| {sim['policy']} | {_one(sim, 'itl_p99_ms')} | {_one(real, 'itl_p99_ms')} | "
                         f"{_pair(sim, *ttft)} | {_pair(real, *ttft)} | {_one(sim, both, _pct)} | "
                         f"{_one(real, both, _pct)} | {_one(sim, tpot, _pct)} | {_one(real, tpot, _pct)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _rows(fig: dict[str, Any]) -> list[tuple[dict, dict | None]]:
    real = {r["policy"]: r for r in fig.get("real", [])}
    return [(s, real.get(s["policy"])) for s in fig["sim"]]


def _share(data: dict[str, Any]) -> str:
    shares = [r["others_cpu_share"] for k in ("starvation", "priority_preemption", "slo_budget")
              for r in data.get(k, {}).get("real_runs", []) if r["others_cpu_share"] is not None]  # fmt: skip
    return f"{max(shares):.0%}" if shares else "n/a (no real runs)"


def update_docs(path: Path, tables: str) -> None:
    """Replace the block between DOCS_BEGIN and DOCS_END in `path` with the tables."""
    text = path.read_text()
    pattern = re.compile(re.escape(DOCS_BEGIN) + r".*?" + re.escape(DOCS_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no block between {DOCS_BEGIN!r} and {DOCS_END!r} to replace")
    path.write_text(pattern.sub(lambda _: f"{DOCS_BEGIN}\n\n{tables}\n{DOCS_END}", text))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- main


def time_scale(arg: str, profile: Any) -> float:
    if arg != "auto":
        return float(arg)
    speed = REFERENCE.predict(PROBE_SHAPE) / profile.step_model.predict(PROBE_SHAPE)
    return min(max(speed, 0.5), 3.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool (default: the engine's)")
    p.add_argument("--figures", default="starvation,priority,slo", help="which of starvation,priority,slo")
    p.add_argument("--size", choices=["real", "smoke"], default="real",
                   help="real: ~1 min a run on the default model; smoke: seconds (tiny models, a look at the flow)")
    p.add_argument("--repeats", type=int, default=2, help="real runs per configuration, alternated")
    p.add_argument("--set", action="append", default=[], metavar="FIGURE.FIELD=JSON",
                   help="change one workload parameter (the Starvation / Priority / Slo dataclasses' fields), "
                   "e.g. slo.rate=1.2 or 'slo.controllers=[\"itl\", \"itl+ttft\"]'; repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", default="auto",
                   help="divide the workloads' times by this (auto: the profiled speed against REFERENCE)")
    p.add_argument("--step-cost-profile", default=None,
                   help="a profile of this runner on this machine (tokenloom profile); default: profile it here")
    p.add_argument("--profile-passes", type=int, default=1)
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--max-wait", type=float, default=0.0,
                   help="seconds to wait for a quiet machine before each profiled shape and each real run")
    p.add_argument("--sim-only", action="store_true", help="profile + simulator only (no real runs)")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop before the real runs when the simulator predicts they take longer (0: no limit)")
    p.add_argument("--out", default=None, help="the result JSON")
    p.add_argument("--update-docs", default=None, metavar="MD",
                   help=f"write the tables into MD between {DOCS_BEGIN!r} and {DOCS_END!r}")
    p.add_argument("--render", default=None, metavar="JSON", help="only print (or --update-docs) a result's tables")
    args = p.parse_args(argv)

    if args.render:
        tables = render(json.loads(Path(args.render).read_text()))
        if args.update_docs:
            update_docs(Path(args.update_docs), tables)
        print(tables, end="")
        return 0
    which = [w.strip() for w in args.figures.split(",") if w.strip()]
    unknown = set(which) - {"starvation", "priority", "slo"}
    if unknown or not which:
        p.error(f"--figures: one or more of starvation, priority, slo (got {args.figures!r})")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        sizes = with_settings(SMOKE if args.size == "smoke" else Sizes(), args.set)
        figures(sizes, 1.0, "profile.json", 1 << 30, args.seed, which)  # bad settings fail here, before loading
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    t_start = time.perf_counter()

    from tokenloom.sim.profile import load_profile
    from tokenloom.sim.profiler import hardware_info

    engine = load_engine(args)
    if args.step_cost_profile:
        profile_path = Path(args.step_cost_profile)
        profile = load_profile(profile_path)
        if profile.is_stale():
            log(f"warning: {profile_path} profiled an older runner; its predictions may be off")
    else:
        profile_path = Path(args.out or "scheduling_policies_real.json").with_suffix(".profile.json")
        profile = calibrate(engine, sizes, args, profile_path)
    scale = time_scale(args.time_scale, profile)
    log(f"workload times / {scale:.2f} (profiled step {profile.step_model.predict(PROBE_SHAPE) * 1e3:.0f} ms, "
        f"sized for {REFERENCE.predict(PROBE_SHAPE) * 1e3:.0f} ms)")
    base = (engine.scheduler_config, engine.cache_config)
    figs = figures(sizes, scale, str(profile_path), engine.model_config.vocab_size, args.seed, which)
    hw = hardware_info(str(engine.runner.device))
    result: dict[str, Any] = {
        "machine": {"date": time.strftime("%Y-%m-%d"), "cpu": hw["cpu"], "cores": hw["cores"],
                    "torch_threads": hw["torch_threads"], "torch": hw["torch"],
                    "model": args.model or "SmolLM2-135M-Instruct",
                    "dtype": str(engine.runner.dtype).replace("torch.", ""), "profile": str(profile_path),
                    "profile_mape": profile.fit.mape, "profile_shapes": profile.fit.num_samples,
                    "time_scale": scale, "reference_probe_ms": REFERENCE.predict(PROBE_SHAPE) * 1e3,
                    "profiled_probe_ms": profile.step_model.predict(PROBE_SHAPE) * 1e3},  # fmt: skip
        "args": vars(args),
    }
    predicted = 0.0
    for fig in figs:
        result[fig.name], seconds = simulate_figure(base, fig, profile, args)
        predicted += seconds
    if not args.sim_only:
        log(f"the real runs: {predicted / 60:.1f} min by the simulator")
        if args.max_minutes and predicted / 60 > args.max_minutes:
            engine.close()
            log(f"that is over --max-minutes {args.max_minutes:g}: not started (fewer --repeats, fewer --figures, "
                "or a quieter machine: a busy one profiles slow and stretches the workloads with --time-scale auto; "
                f"--step-cost-profile {profile_path} skips the profiling next time)")
            return 3
        warm_up(engine, sizes, args.seed)
        for fig in figs:
            run_figure(engine, base, fig, result[fig.name], args)
    engine.close()
    result["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    tables = render(result)
    if args.update_docs:
        update_docs(Path(args.update_docs), tables)
    print(tables, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
