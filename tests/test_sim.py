"""The simulator: same scheduler, modelled step times, bench-shaped results."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from tokenloom.cli import main as cli_main
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.cost_model import TERMS, CostModel, StepShape
from tokenloom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.core.replay import replay
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.engine.core import EngineCore
from tokenloom.engine.executor import UniProcExecutor
from tokenloom.sampling_params import SamplingParams
from tokenloom.sim.cost_fit import Sample, fit
from tokenloom.sim.executor import SimulatedExecutor
from tokenloom.sim.profile import Profile, load_profile, runner_fingerprint
from tokenloom.sim.runner import SimulatedRunner
from tokenloom.sim.simulate import simulate
from tokenloom.workload.clock import VirtualClock
from tokenloom.workload.datasets import BenchRequest, load_sharegpt

UNIT = CostModel({"overhead": 1.0})  # every step lasts one second: arrival_s = step index


def _trace_requests() -> list[dict]:
    """Mixed lengths, a shared prefix, later arrivals, and a pool small enough to preempt."""
    rng = np.random.default_rng(3)
    prefix = [int(t) for t in rng.integers(20, 300, size=24)]
    reqs = []
    for i in range(12):
        body = [int(t) for t in rng.integers(20, 300, size=int(rng.integers(3, 40)))]
        reqs.append({"id": f"r{i}", "arrival_step": [0, 0, 0, 1, 2, 2, 3, 5, 5, 6, 8, 9][i],
                     "prompt_token_ids": (prefix if i % 3 == 0 else []) + body,
                     "max_tokens": int(rng.integers(1, 24)), "priority": 0})  # fmt: skip
    return reqs


CONFIG = {"max_num_batched_tokens": 32, "max_num_seqs": 6, "long_prefill_token_threshold": 12, "block_size": 4,
          "num_blocks": 40, "max_model_len": 128, "enable_prefix_caching": True}  # fmt: skip


def _configs(config: dict) -> tuple[SchedulerConfig, CacheConfig]:
    cache_keys = {"block_size", "num_blocks", "enable_prefix_caching"}
    return (SchedulerConfig(**{k: v for k, v in config.items() if k not in cache_keys}),
            CacheConfig(**{k: v for k, v in config.items() if k in cache_keys}))  # fmt: skip


def _bench_requests(trace_reqs: list[dict]) -> list[BenchRequest]:
    return [BenchRequest(r["id"], r["prompt_token_ids"], len(r["prompt_token_ids"]), r["max_tokens"], True,
                         float(r["arrival_step"])) for r in trace_reqs]  # fmt: skip


def _sim_steps(requests: list[BenchRequest], config: dict, cost: CostModel = UNIT) -> list[dict]:
    sink = io.StringIO()
    simulate(requests, *_configs(config), cost, trace=sink)
    return [json.loads(line) for line in sink.getvalue().splitlines()]


def _decisions(steps: list[dict]) -> list[tuple]:
    return [(s["scheduled"], sorted(s["preempted"]), sorted(s["finished"])) for s in steps if s["scheduled"]]


# ----------------------------------------------------------------------------------- same schedules


def test_simulated_schedule_equals_replay_step_for_step() -> None:
    trace = {"config": CONFIG, "requests": _trace_requests()}
    expected = replay(trace)
    assert expected["summary"]["num_preemptions"] > 0  # the case is worth comparing
    assert all(s["scheduled"] for s in expected["steps"])  # no idle steps: step k starts at t = k
    sim = _sim_steps(_bench_requests(trace["requests"]), CONFIG)
    assert _decisions(sim) == _decisions(expected["steps"])
    assert [s["t_start"] for s in sim] == [float(k) for k in range(len(sim))]


def _drive_by_step(core: EngineCore, trace_reqs: list[dict], max_steps: int = 500) -> list[tuple]:
    """Replay-style: requests enter before their arrival step; one engine step per step."""
    decisions = []
    for step in range(max_steps):
        for r in trace_reqs:
            if r["arrival_step"] == step:
                params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
                core.add_request(Request(r["id"], r["prompt_token_ids"], params, arrival_time=float(step)))
        if not core.scheduler.has_requests() and step > max(r["arrival_step"] for r in trace_reqs):
            return decisions
        out = core.scheduler.schedule()
        runner_out = core.executor.execute_model(out)
        finished = [o.request_id for o in core.scheduler.update_from_output(out, runner_out) if o.finished]
        if out.num_scheduled_tokens:
            decisions.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids), sorted(finished)))
    raise AssertionError("did not drain")


def test_simulated_runner_schedules_like_the_real_runner(tmp_path: Path) -> None:
    """Same trace through EngineCore with the torch ModelRunner (tiny random model) and with the
    SimulatedRunner: identical steps, because both sample exactly when a request reaches its length."""
    from tests import tiny_models  # a hard dependency (transformers): an import error must fail, not skip
    from tokenloom.model.loader import load_model
    from tokenloom.model.runner import ModelRunner

    trace_reqs = [dict(r, prompt_token_ids=[t % 300 for t in r["prompt_token_ids"]]) for r in _trace_requests()]
    loaded = load_model(tiny_models.make_tiny_hf_model(tmp_path, "llama"))
    sched_cfg, cache_cfg = _configs(CONFIG)
    real_runner = ModelRunner(loaded, block_size=cache_cfg.block_size, num_blocks=cache_cfg.num_blocks,
                              dtype="float32", device="cpu")  # fmt: skip
    real = _drive_by_step(EngineCore(Scheduler(sched_cfg, cache_cfg), UniProcExecutor(real_runner)), trace_reqs)
    clock = VirtualClock()
    sim_core = EngineCore(Scheduler(sched_cfg, cache_cfg, clock=clock), SimulatedExecutor(UNIT, clock))
    sim = _drive_by_step(sim_core, trace_reqs)
    assert any(pre for _, pre, _ in real)
    assert sim == real


# ----------------------------------------------------------------------------------- the seeds' cases


def _decodes_then_prefill(d: int, p: int) -> list[BenchRequest]:
    """D one-token prompts at t=0 (decoding from step 1 on), one P-token prompt arriving at t=1."""
    reqs = [BenchRequest(f"d{i}", [100 + i], 1, 1000, True, 0.0) for i in range(d)]
    return reqs + [BenchRequest("p", [99] * p, p, 4, True, 1.0)]


def _seed_config(budget: int, max_seqs: int) -> dict:
    return {"max_num_batched_tokens": budget, "max_num_seqs": max_seqs, "max_model_len": 2048, "num_blocks": 4096,
            "block_size": 16, "enable_prefix_caching": False}  # fmt: skip


@pytest.mark.parametrize("budget, max_seqs, decodes, prefill", [(16, 16, 10, 6), (32, 32, 10, 22), (10, 10, 10, 0)])
def test_table3_rows_come_out_of_the_simulator(budget: int, max_seqs: int, decodes: int, prefill: int) -> None:
    """Table 3 of seed 000 (D=10, P=24), valid variants: the seed's B=8 / M=32 rows break B >= M."""
    steps = _sim_steps(_decodes_then_prefill(10, 24), _seed_config(budget, max_seqs))
    step1 = steps[1]
    assert sum(n for rid, n in step1["scheduled"].items() if rid != "p") == decodes
    assert step1["scheduled"].get("p", 0) == prefill


def test_groups_a_and_b() -> None:
    a = _sim_steps(_decodes_then_prefill(10, 24), _seed_config(16, 16))
    assert [s["prefill"].get("p", 0) for s in a[1:5]] == [6, 6, 6, 6]
    assert a[4]["decode"] == {f"d{i}": 1 for i in range(10)}
    b = _sim_steps(_decodes_then_prefill(16, 24), _seed_config(16, 16))
    # The 16 decodes eat the budget: the prompt gets nothing until they finish, 1000 tokens later.
    assert all("p" not in s["scheduled"] and s["bound_by"] == "budget" for s in b[1:1000])


def test_three_request_timeline_of_001() -> None:
    reqs = [BenchRequest("A", [1] * 4, 4, 2, True, 0.0), BenchRequest("B", [2] * 8, 8, 3, True, 0.0),
            BenchRequest("C", [3] * 3, 3, 2, True, 1.0)]  # fmt: skip
    config = {"max_num_batched_tokens": 6, "max_num_seqs": 4, "long_prefill_token_threshold": 4, "block_size": 4,
              "num_blocks": 64, "max_model_len": 64, "enable_prefix_caching": False}  # fmt: skip
    steps = _sim_steps(reqs, config)
    assert [s["scheduled"] for s in steps] == [{"A": 4, "B": 2}, {"A": 1, "B": 4, "C": 1}, {"B": 2, "C": 2},
                                               {"B": 1, "C": 1}, {"B": 1}]  # fmt: skip
    assert sum(s["budget_used"] for s in steps) == 19
    assert [s["finished"] for s in steps] == [[], ["A"], [], ["C"], ["B"]]


# ------------------------------------------------------------------------------------- the cost model


def _random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        rows = [(int(rng.integers(0, 1024)), 1, True) for _ in range(int(rng.integers(0, 64)))]
        rows += [(int(rng.integers(0, 512)), int(rng.integers(2, 512)), bool(rng.integers(0, 2)))
                 for _ in range(int(rng.integers(0, 4)))]  # fmt: skip
        shapes.append(StepShape.of_rows(rows or [(0, 8, True)]))
    return shapes


TRUE_COEFFICIENTS = {"overhead": 4e-3, "prefill_tokens": 3e-4, "decode_tokens": 9e-4, "gemm_rows": 1e-4,
                     "prefill_attn": 2e-8, "decode_attn": 5e-8, "num_seqs": 1e-4, "num_samples": 6e-4}  # fmt: skip


def test_fit_recovers_known_coefficients() -> None:
    truth = CostModel(TRUE_COEFFICIENTS)
    samples = [Sample(s, truth.predict(s)) for s in _random_shapes(80)]
    model, error = fit(samples)
    for term in TERMS:
        assert model.coefficients[term] == pytest.approx(TRUE_COEFFICIENTS[term], rel=1e-6), term
    assert error.mape < 1e-9 and error.r2 == pytest.approx(1.0)


def test_fit_with_noise_reports_its_error_and_predicts_new_shapes() -> None:
    truth = CostModel(TRUE_COEFFICIENTS)
    rng = np.random.default_rng(1)
    samples = [Sample(s, truth.predict(s) * float(rng.uniform(0.97, 1.03))) for s in _random_shapes(200)]
    model, error = fit(samples)
    assert 0.005 < error.mape < 0.03 and error.r2 > 0.99
    # With noise, nearly collinear terms (a decode adds one to decode_tokens, num_seqs and num_samples)
    # may trade cost between them; what matters is predicting shapes the fit never saw.
    unseen = _random_shapes(100, seed=7)
    errors = [abs(model.predict(s) - truth.predict(s)) / truth.predict(s) for s in unseen]
    assert float(np.mean(errors)) < 0.02


def test_fit_never_returns_negative_costs() -> None:
    # Two collinear features and timings that a free fit would explain with a negative term.
    shapes = [StepShape.of_rows([(0, n, True)]) for n in (8, 16, 32, 64, 128)]
    samples = [Sample(s, 1e-3 + 1e-4 * s.prefill_tokens - 1e-9 * s.prefill_attn) for s in shapes]
    model, _ = fit(samples)
    assert all(c >= 0 for c in model.coefficients.values())


def test_step_shape_follows_the_runner() -> None:
    """One-token rows are decodes (attention over each own context: the sum); longer rows are chunks."""
    shape = StepShape.of_rows([(9, 1, True), (99, 1, True), (0, 4, True), (10, 3, False)])
    assert (shape.decode_tokens, shape.decode_max_context, shape.decode_attn) == (2, 100, 110)
    assert shape.prefill_tokens == 7
    assert shape.prefill_attn == (1 + 2 + 3 + 4) + (11 + 12 + 13)
    assert (shape.num_seqs, shape.num_samples) == (4, 3)


# ---------------------------------------------------------------------------------- virtual time


def test_runner_advances_the_clock_by_the_modelled_step_time() -> None:
    cost = CostModel(TRUE_COEFFICIENTS)
    clock = VirtualClock(5.0)
    runner = SimulatedRunner(cost, clock)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    step1 = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1] * 10, [1] * 10, params, ([0],), 0),
                            NewRequestData("b", [2] * 30, [2] * 30, params, ([1, 2],), 0)],
        scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={"a": 10, "b": 20},
        total_num_scheduled_tokens=30,
    )  # fmt: skip
    out = runner.execute_model(step1)
    expected = cost.predict(StepShape.of_rows([(0, 10, True), (0, 20, False)]))
    assert out.execute_time == pytest.approx(expected) and clock() == pytest.approx(5.0 + expected)
    assert out.sampled_token_ids == [[7], []]  # a reached its length; b's chunk stopped short
    step2 = SchedulerOutput([], CachedRequestData(["a", "b"], [([],), ([],)], [10, 20]), {"a": 1, "b": 10}, 11)
    out2 = runner.execute_model(step2)
    assert out2.sampled_token_ids == [[7], [7]]
    assert out2.execute_time == pytest.approx(cost.predict(StepShape.of_rows([(10, 1, True), (20, 10, True)])))


def test_latencies_are_sums_of_modelled_steps() -> None:
    cost = CostModel(TRUE_COEFFICIENTS)
    req = BenchRequest("x", [5] * 100, 100, 4, True, 2.5)
    sched, cache = _configs({"max_num_batched_tokens": 512, "max_num_seqs": 4, "max_model_len": 512, "num_blocks": 64})
    result = simulate([req], sched, cache, cost)
    prefill = cost.predict(StepShape.of_rows([(0, 100, True)]))
    decodes = [cost.predict(StepShape.of_rows([(100 + i, 1, True)])) for i in range(3)]
    rec = result.records[0]
    assert rec.ttft_s == pytest.approx(prefill)  # the clock jumped to the arrival at 2.5 s first
    assert rec.itl_s == pytest.approx(decodes)
    assert rec.e2e_s == pytest.approx(prefill + sum(decodes))
    assert rec.queue_time_s == 0.0 and rec.output_tokens == 4


# --------------------------------------------------------------------------------- results and speed


def _shipped_or_synthetic_profile(tmp_path: Path) -> str:
    try:
        load_profile()
        return "default"
    except FileNotFoundError:
        from tokenloom.sim.cost_fit import FitError

        path = tmp_path / "synthetic.json"
        Profile("synthetic", "bfloat16", 16, {}, CostModel(TRUE_COEFFICIENTS), FitError(0, 0, 1, 0),
                max_model_len=8192, kv_bytes_per_token=23040).save(path)  # fmt: skip
        return str(path)


def test_simulate_cli_writes_bench_shaped_results_and_a_plottable_trace(tmp_path: Path, capsys) -> None:
    from tokenloom.bench.plots import load_bench_result, plot_timeline

    profile = _shipped_or_synthetic_profile(tmp_path)
    result_file, trace_file = tmp_path / "sim.json", tmp_path / "steps.jsonl"
    rc = cli_main(["simulate", "--profile", profile, "--workload", "random", "--num-prompts", "40",
                   "--random-input-len", "200", "--random-output-len", "30", "--request-rate", "8",
                   "--max-num-seqs", "8", "--result-file", str(result_file),
                   "--trace-steps", str(trace_file)])  # fmt: skip
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(result_file.read_text())
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "median_e2el_ms",
                "output_throughput", "request_throughput", "total_token_throughput", "duration", "completed",
                "ttfts", "itls", "e2els", "input_lens", "output_lens", "requests"):  # fmt: skip
        assert key in data, key
    assert data["completed"] == 40 and data["backend"] == "tokenloom-sim"
    assert data["output_lens"] == [r["max_tokens"] for r in data["requests"]]
    assert load_bench_result(result_file).ttfts_s
    steps = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert max(s["num_running"] for s in steps) == 8
    assert plot_timeline(trace_file, tmp_path / "t.png").stat().st_size > 10_000


def test_sweep_prints_one_row_per_value(tmp_path: Path, capsys) -> None:
    profile = _shipped_or_synthetic_profile(tmp_path)
    rc = cli_main(["simulate", "--profile", profile, "--num-prompts", "30", "--random-input-len", "64",
                   "--random-output-len", "16", "--sweep", "max-num-seqs=2,8,32"])  # fmt: skip
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["max_num_seqs", "TTFT", "p50"]
    assert [ln.split()[0] for ln in lines[2:]] == ["2", "8", "32"]


def test_a_thousand_sharegpt_requests_simulate_quickly() -> None:
    requests = load_sharegpt(num=1000, seed=0)
    sched, cache = _configs({"max_num_batched_tokens": 2048, "max_num_seqs": 128, "max_model_len": 2048,
                             "num_blocks": 20000})  # fmt: skip
    # CPU time, not wall time: other jobs on a shared machine must not fail it; the bound catches
    # an order-of-magnitude regression (a few seconds on the dev box), speed figures live in benchmarks.
    t0 = time.process_time()
    result = simulate(requests, sched, cache, CostModel(TRUE_COEFFICIENTS))
    assert time.process_time() - t0 < 20.0
    assert result.metrics["completed"] == 1000
    assert result.metrics["total_output_tokens"] == sum(r.max_tokens for r in requests)


def test_profile_round_trip(tmp_path: Path) -> None:
    from tokenloom.sim.cost_fit import FitError

    prof = Profile("m", "float32", 16, {"cpu": "x"}, CostModel(TRUE_COEFFICIENTS), FitError(0.02, 0.05, 0.99, 2),
                   samples=[Sample(StepShape.of_rows([(0, 8, True)]), 0.01)], scheduler_overhead={"num_seqs": 1e-6},
                   max_model_len=4096, kv_bytes_per_token=100)  # fmt: skip
    prof.save(tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.cost_model.coefficients == prof.cost_model.coefficients
    assert back.samples == prof.samples and back.fit == prof.fit
    assert back.step_model.coefficients["num_seqs"] == pytest.approx(TRUE_COEFFICIENTS["num_seqs"] + 1e-6)
    # A profile remembers the runner code it measured, and says when that code has changed since.
    assert not back.is_stale()  # no fingerprint recorded: nothing to compare
    back.runner_fingerprint = runner_fingerprint()
    assert not back.is_stale()
    back.runner_fingerprint = "0" * 16
    assert back.is_stale()


def test_profile_command_on_a_tiny_model(tmp_path: Path) -> None:
    from tests import tiny_models  # a hard dependency (transformers): an import error must fail, not skip
    model_dir = tiny_models.make_tiny_hf_model(tmp_path, "llama")
    out = tmp_path / "tiny.json"
    assert cli_main(["profile", str(model_dir), "--quick", "--dtype", "float32", "--repeats", "2", "--warmup", "1",
                     "--passes", "1", "--max-wait", "0", "-o", str(out)]) == 0  # fmt: skip
    prof = load_profile(out)
    assert prof.fit.num_samples == len(prof.samples) > 5
    assert prof.kv_bytes_per_token > 0 and prof.scheduler_overhead["num_seqs"] > 0
    assert all(c >= 0 for c in prof.cost_model.coefficients.values())


def test_shipped_profiles_are_current_and_say_what_they_measured() -> None:
    """A runner change must come with re-measured (or, if it changes no step time, re-stamped)
    shipped profiles: a stale one silently simulates the old code."""
    default, int8 = load_profile("default"), load_profile("int8")
    assert (default.quantization, int8.quantization) == (None, "int8")
    assert default.dtype == int8.dtype == "bfloat16"
    assert not default.is_stale() and not int8.is_stale()
    # int8 layers make prefill cheaper per token: the profiles must differ where the GEMMs are.
    prefill = StepShape.of_rows([(0, 512, True)])
    assert int8.step_model.predict(prefill) < 0.8 * default.step_model.predict(prefill)


def test_profile_command_records_quantization(tmp_path: Path) -> None:
    from tests import tiny_models  # a hard dependency (transformers): an import error must fail, not skip
    model_dir = tiny_models.make_tiny_hf_model(tmp_path, "llama")
    out = tmp_path / "tiny-int8.json"
    assert cli_main(["profile", str(model_dir), "--quick", "--dtype", "float32", "--quantization", "int8",
                     "--repeats", "1", "--warmup", "1", "--passes", "1", "--max-wait", "0", "-o", str(out)]) == 0
    assert load_profile(out).quantization == "int8"


def _refit_disagreements(prof: Profile) -> list[str]:
    """Where the profile's fit is not what fitting its own samples with this code gives: its coefficients
    (compared through their predictions, which do not depend on how a BLAS resolves a near-tie between
    terms) and its recorded fit error."""
    refit, error = fit(prof.samples)
    problems = []
    probes = [s.shape for s in prof.samples] + [StepShape.of_rows([(0, 2000, True)]),
                                                StepShape.of_rows([(1000, 1, True)] * 64)]
    for shape in probes:
        recorded, now = prof.cost_model.predict(shape), refit.predict(shape)
        if abs(recorded / now - 1) > 1e-6:
            problems.append(f"{shape}: the profile predicts {recorded:.6g} s, its samples refitted {now:.6g} s")
    for name in ("mape", "max_ape", "r2"):
        if abs(getattr(prof.fit, name) - getattr(error, name)) > 1e-6:
            problems.append(f"fit.{name} {getattr(prof.fit, name)} recorded, {getattr(error, name)} refitted")
    if prof.fit.num_samples != len(prof.samples):
        problems.append(f"fit.num_samples {prof.fit.num_samples} for {len(prof.samples)} samples")
    return problems


@pytest.mark.parametrize("name", ["default", "int8"])
def test_shipped_profile_is_the_fit_of_its_own_samples(name: str) -> None:
    """Runs on any CPU, in milliseconds: a shipped profile's coefficients and fit error must be what
    fitting its samples with this tree's cost model gives. Fails for hand-tuned coefficients, samples of
    one run stitched to the fit of another, and a change to the step features (core/gemm_rows.py's
    buckets, StepShape) re-stamped without re-fitting. It cannot see a runner that got faster or slower
    with the same features: only timing on the profile's hardware can (the test below;
    docs/simulator.md, "What the profile checks catch")."""
    prof = load_profile(name)
    assert prof.samples and all(s.seconds > 0 for s in prof.samples)
    assert _refit_disagreements(prof) == []
    # The check has teeth: one coefficient moved by 20 %, as a hand "correction" would, is caught.
    tuned = load_profile(name)
    tuned.cost_model = CostModel({**tuned.cost_model.coefficients,
                                  "overhead": tuned.cost_model.coefficients["overhead"] * 1.2})
    assert _refit_disagreements(tuned)


def test_hardware_identity_tells_masked_cpu_names_apart() -> None:
    """Two 2-core VMs both named "AMD EPYC" (a Zen 4 and a Zen 5: the same profile was 2x off on the second)
    are different hardware; so is one CPU capped to another ISA level; a profile from before the family,
    model and flags were recorded matches nothing."""
    from tokenloom.sim.profiler import hardware_info, hardware_mismatch

    zen4 = {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17", "cores": 2,
            "isa": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]}  # fmt: skip
    zen5 = dict(zen4, cpu_family="26", cpu_model="2")
    assert hardware_mismatch(zen4, dict(zen4, torch_threads=1)) is None  # only the identity keys count
    assert "cpu_family" in (hardware_mismatch(zen4, zen5) or "")
    assert "isa" in (hardware_mismatch(zen4, dict(zen4, isa=["avx2"])) or "")
    assert "cores" in (hardware_mismatch(zen4, dict(zen4, cores=4)) or "")
    old = {"cpu": "AMD EPYC", "cores": 2}
    assert "re-profile" in (hardware_mismatch(old, zen4) or "")
    here = hardware_info("cpu")
    assert hardware_mismatch(here, hardware_info("cpu")) is None
    assert set(here["isa"]) <= {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile"}


def test_shipped_profile_predicts_this_runner_within_its_own_fit_error() -> None:
    """`is_stale` compares a source hash only, so re-stamping without re-measuring passes it. This times
    three step shapes (a prefill, a decode batch, a mixed step) of the default model on the real runner
    and holds the profile to them, within its own fit error: max APE + 3 x MAPE over its samples.
    Skipped on other hardware than the profile's, and when the CPUs stay busy with other work (on a
    2-core machine a neighbour slows every op several times over: the times would be the neighbour's)."""
    import torch

    from tokenloom.model.loader import load_model, resolve_model_path
    from tokenloom.model.runner import ModelRunner
    from tokenloom.sim.profiler import Row, StepDriver, hardware_info, hardware_mismatch
    from tokenloom.sim.quiet import wait_for_quiet

    prof = load_profile("default")
    if (why := hardware_mismatch(prof.hardware, hardware_info("cpu"))) is not None:
        pytest.skip(f"not the profile's hardware: {why}")
    if not wait_for_quiet(10.0):  # before loading the model: a busy machine skips at little cost
        pytest.skip("the CPUs stayed busy with other work: step times would describe the neighbours")
    runner = ModelRunner(load_model(resolve_model_path(None), torch.bfloat16), block_size=prof.block_size,
                         num_blocks=512, dtype=prof.dtype, device="cpu")
    driver = StepDriver(runner, prof.block_size, runner.vocab_size)
    tolerance = prof.fit.max_ape + 3 * prof.fit.mape
    shapes = [[Row(0, 192)], [Row(64, 1)] * 16, [Row(256, 1)] * 16 + [Row(0, 256, False)]]
    for rows in shapes:
        if not wait_for_quiet(10.0):
            pytest.skip("the CPUs stayed busy with other work: step times would describe the neighbours")
        sample = driver.time_shape(rows, warmup=2, repeats=5)
        predicted = prof.cost_model.predict(sample.shape)
        assert abs(sample.seconds / predicted - 1) <= tolerance, (rows[0], len(rows), sample.seconds, predicted)


def test_pooling_steps_are_priced_as_prefill_and_finish_there() -> None:
    """Pooling requests through the simulator (issue 33): prefill rows without an LM-head row, pooled
    in the step that ends the prompt, finished there by the scheduler (blocks back in the pool)."""
    from tokenloom.pooling_params import PoolingParams

    cost = CostModel(TRUE_COEFFICIENTS)
    clock = VirtualClock(0.0)
    runner = SimulatedRunner(cost, clock)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                      CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False), clock=clock)
    for i, n in enumerate((10, 30, 40)):
        sched.add_request(Request(f"p{i}", [3] * n, pooling_params=PoolingParams(task="embed")))
    steps = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        out = runner.execute_model(so)
        steps.append((dict(so.num_scheduled_tokens), out.execute_time,
                      [o.request_id for o in sched.update_from_output(so, out) if o.finished]))
    # Step 1: 10 + 30 whole and 24 of the 40 (chunked: causal pooling), no LM head anywhere.
    assert steps[0][0] == {"p0": 10, "p1": 30, "p2": 24} and steps[0][2] == ["p0", "p1"]
    assert steps[0][1] == pytest.approx(cost.predict(StepShape.of_rows([(0, 10, False), (0, 30, False),
                                                                         (0, 24, False)])))
    assert steps[1][0] == {"p2": 16} and steps[1][2] == ["p2"] and len(steps) == 2
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
