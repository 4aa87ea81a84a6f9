"""The SLO controller's correction of its predictions by measured step times
(tokenloom/core/step_time_correction.py, Scheduler.observe_step_time): it converges when the real cost
is a constant multiple of the profile's, a single outlier step moves it only a bounded amount, the
simulator with a mis-scaled profile keeps the ITL target, and with an exact profile nothing changes."""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sched_utils import PINNED_SIM_PROFILE, assert_scheduler_empty, create_requests, step
from tests.test_scheduler_properties import _block_accounting
from tests.test_slo_budget import LINEAR, _slo_traces
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.cost_model import CostModel
from tokenloom.core.replay_runner import ReplayRunner
from tokenloom.core.request import Request
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.core.step_time_correction import (
    ALPHA,
    CLIP,
    MAX_FACTOR,
    MIN_FACTOR,
    SPREAD,
    WARMUP,
    RegimeCorrection,
    StepTimeCorrection,
)
from tokenloom.sampling_params import SamplingParams

ratios = st.floats(0.3, 3.5)
# A step as the profile predicts it: (decode part with the overhead, prefill part), a few decode-only.
steps = st.lists(st.tuples(st.floats(0.001, 1.0), st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 1.0])),
                 min_size=1, max_size=20).map(lambda s: s + [(0.05, 0.0), (0.05, 0.2)])


@settings(max_examples=200, deadline=None)
@given(k=ratios, steps=steps)
def test_a_constant_multiple_is_learnt_exactly_after_the_warm_up(k, steps) -> None:
    c = StepTimeCorrection()
    for i in range(10 * WARMUP):
        d, p = steps[i % len(steps)]
        assert c.seconds(d + p, d, high=True) == d + p or c.decode.warm or c.prefill.warm  # the profile as is
        c.observe(d + p, d, k * (d + p))
    for d, p in steps:
        assert abs(c.seconds(d + p, d, high=False) / (k * (d + p)) - 1) < 1e-9
        assert abs(c.seconds(d + p, d, high=True) / (k * (d + p)) - 1) < 1e-9


@settings(max_examples=200, deadline=None)
@given(kd=ratios, kp=ratios, steps=steps)
def test_converges_when_decodes_and_prefills_are_off_by_different_factors(kd, kp, steps) -> None:
    # E.g. a faster decode kernel than the profiled one (kd < 1) with the same prefill cost (kp = 1).
    c = StepTimeCorrection()
    for i in range(200 * len(steps)):
        d, p = steps[i % len(steps)]
        c.observe(d + p, d, kd * d + kp * p)
    assert abs(c.decode.mean / kd - 1) < 0.01 and abs(c.prefill.mean / kp - 1) < 0.01
    for d, p in steps:
        real = kd * d + kp * p
        assert abs(c.seconds(d + p, d, high=False) / real - 1) < 0.01
        assert real * 0.99 <= c.seconds(d + p, d, high=True) <= real * 1.03


@settings(max_examples=300, deadline=None)
@given(k=ratios, noise=st.lists(st.floats(-0.3, 0.3), min_size=WARMUP, max_size=60),
       outlier=st.floats(1e-3, 1e3))
def test_a_single_outlier_step_moves_the_correction_a_bounded_amount(k, noise, outlier) -> None:
    r = RegimeCorrection()
    for e in noise:
        r.observe(k * (1 + e))
    mean, high = r.mean, r.high
    r.observe(outlier)
    # At most ALPHA * (CLIP - 1) up for the mean, and the deviation likewise: the one-step factor
    # grows by at most (1 + ALPHA (CLIP - 1) (1 + SPREAD)), 15 % here, however far off the step was.
    assert mean * (1 - ALPHA * (1 - 1 / CLIP)) - 1e-9 <= r.mean <= mean * (1 + ALPHA * (CLIP - 1)) + 1e-9
    assert r.high <= high * (1 + ALPHA * (CLIP - 1) * (1 + SPREAD)) + 1e-9
    assert MIN_FACTOR <= r.mean <= r.high <= MAX_FACTOR


def test_outliers_in_the_warm_up_do_not_set_the_correction() -> None:
    r = RegimeCorrection()
    for x in (40.0, 1.2, 1.2, 1.2, 1.2):  # the engine's first step (allocations, cold caches)
        r.observe(x)
    assert r.mean == 1.2 and r.deviation == 0.0


def test_ratios_out_of_range_are_bounded() -> None:
    r = RegimeCorrection()
    for _ in range(400):
        r.observe(1e6)
    assert r.mean == r.high == MAX_FACTOR
    c = StepTimeCorrection()
    c.observe(0.0, 0.0, 1.0)  # a step predicted free (empty) teaches nothing
    c.observe(1.0, 1.0, 0.0)
    assert c.decode.num_observed == 0


# ----------------------------------------------------------------- through the scheduler's seam
COST = CostModel({"overhead": 0.010, "prefill_tokens": 0.001, "decode_tokens": 0.001})


def _decodes_and_a_prompt(clock: str = "engine"):
    """10 decodes and a 200-token prompt under 10 ms + 1 ms a token, a 50.5 ms ITL target: 40 tokens a
    step (30 for the prompt) when steps cost what the profile says."""
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=64, max_model_len=4096, slo_clock=clock,
                          target_itl_ms=50.5)
    sched = make_scheduler(cfg, CacheConfig(block_size=16, num_blocks=4000), clock=lambda: 0.0, step_cost_model=COST)
    for r in create_requests(10, num_tokens=1, max_tokens=2000, ignore_eos=True, prefix="d"):
        sched.add_request(r)
    sched.add_request(Request("p", [5] * 3000, SamplingParams(max_tokens=4, ignore_eos=True)))
    return sched


def _run(sched, factor, steps: int) -> list[int]:
    """`steps` steps that each take `factor` times their prediction; the prompt's tokens in each."""
    got = []
    for _ in range(steps):
        out, _ = step(sched)
        got.append(out.num_scheduled_tokens.get("p", 0))
        sched.observe_step_time(out, factor * out.predicted_step[0])
    return got


def test_steps_twice_as_slow_as_predicted_shrink_the_budget() -> None:
    sched = _decodes_and_a_prompt()
    got = _run(sched, 2.0, 12)
    # The first step (no decodes yet) takes the ceiling; the profile is trusted during the warm-up; then
    # 20 ms + 2 ms a token: 15 tokens within 50.5 ms, 5 for the prompt.
    assert got[1:WARMUP] == [30] * (WARMUP - 1) and got[-1] == 5
    out, _ = step(sched)
    assert out.policy_actions["slo_budget"]["correction"] == {"decode": 2.0, "prefill": 2.0}


def test_a_single_outlier_does_not_collapse_the_budget() -> None:
    sched = _decodes_and_a_prompt()
    assert _run(sched, 1.0, 10)[-1] == 30
    out, _ = step(sched)
    sched.observe_step_time(out, 100.0 * out.predicted_step[0])  # one step 100x over its prediction
    after = _run(sched, 1.0, 40)
    assert after[0] >= 23  # 1.15x at worst: (10 + b) * 1.15 <= 50.5 for b = 33
    assert after[-1] == 30  # and back once the deviation it left decays


def test_predicted_clock_keeps_the_profile_alone() -> None:
    # The predicted clock is deterministic wherever it runs: measured times do not enter.
    sched = _decodes_and_a_prompt(clock="predicted")
    assert _run(sched, 2.0, 12)[-1] == 30


def test_nothing_is_predicted_or_observed_without_the_controller() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=64, max_model_len=4096)
    sched = make_scheduler(cfg, CacheConfig(block_size=16, num_blocks=4000), clock=lambda: 0.0)
    sched.add_request(Request("p", [5] * 30, SamplingParams(max_tokens=4)))
    out, _ = step(sched)
    assert out.predicted_step is None
    sched.observe_step_time(out, 1.0)  # a no-op


# ------------------------------------------------------------------------------- the simulator
def _chats_and_documents(n: int = 30):
    from tokenloom.workload.datasets import BenchRequest

    rng = np.random.default_rng(0)
    reqs, t = [], 0.0
    for i in range(n):
        t += float(rng.exponential(0.5))
        size = 2000 if i % 4 == 3 else int(rng.integers(100, 400))
        reqs.append(BenchRequest(f"r{i}", [int(x) for x in rng.integers(100, 40000, size)], size, 64, True, t))
    return reqs


def _simulate(k: float, clock: str = "engine"):
    """The pinned profile runs the simulation; the controller predicts with it times `k`."""
    from tokenloom.sim.profile import load_profile
    from tokenloom.sim.simulate import simulate

    real = load_profile(PINNED_SIM_PROFILE).step_model
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096, target_itl_ms=150,
                          slo_clock=clock)
    res = simulate(_chats_and_documents(), cfg, CacheConfig(block_size=16, num_blocks=20000), real,
                   controller_cost_model=CostModel({t: c * k for t, c in real.coefficients.items()}))
    return np.array([x for r in res.records for x in r.itl_s])


@settings(max_examples=6, deadline=None)
@given(k=st.sampled_from([0.4, 0.5, 0.7, 0.85, 1.3, 2.0]))
def test_simulator_with_a_mis_scaled_profile_keeps_itl_near_the_target(k) -> None:
    itl = _simulate(k)
    # Only steps before a regime's warm-up is over can be off: a handful of gaps out of thousands.
    assert np.percentile(itl, 99) <= 0.150 + 1e-6
    assert np.mean(itl > 0.150 + 1e-6) < 0.005


def test_without_the_correction_a_mis_scaled_profile_misses_the_target() -> None:
    # The same run with the predicted clock (the profile alone): what the correction fixes.
    assert np.percentile(_simulate(0.5, clock="predicted"), 99) > 0.2


def test_simulator_with_the_exact_profile_is_unchanged() -> None:
    """The simulator reports its virtual step time, the profile's own prediction: every ratio is 1."""
    from tokenloom.engine.core import EngineCore
    from tokenloom.sim.executor import SimulatedExecutor
    from tokenloom.sim.profile import load_profile
    from tokenloom.workload.clock import VirtualClock
    from tokenloom.workload.driver import run_workload

    model = load_profile(PINNED_SIM_PROFILE).step_model
    clock = VirtualClock()
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096, target_itl_ms=150)
    sched = make_scheduler(cfg, CacheConfig(block_size=16, num_blocks=20000), clock=clock, step_cost_model=model)
    run_workload(_chats_and_documents(12), EngineCore(sched, SimulatedExecutor(model, clock)), clock)
    c = sched.slo_budget.correction
    assert c.decode.num_observed > WARMUP and c.prefill.num_observed > WARMUP
    assert (c.decode.mean, c.decode.deviation, c.prefill.mean, c.prefill.deviation) == (1.0, 0.0, 1.0, 0.0)


# ------------------------------------------------------------------ random traces, noisy machine
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=_slo_traces(), factors=st.lists(st.floats(0.05, 50.0), min_size=1, max_size=30))
def test_invariants_hold_whatever_the_measured_steps(trace, factors) -> None:
    """The engine clock (corrections on), each step measured at a factor of its prediction drawn from
    a wide range (outliers included): the budget stays within the ceiling and never below the decodes'
    own tokens, the blocks stay accounted for, every trace drains, and the factors stay bounded."""
    config, cache, requests = trace
    cfg = SchedulerConfig(**{**config, "slo_clock": "engine"})
    sched = make_scheduler(cfg, CacheConfig(**cache), clock=lambda: 0.0, step_cost_model=LINEAR)
    runner = ReplayRunner(sched)
    pending = sorted(requests, key=lambda r: (r[1], r[0]))
    for step_no in range(3000):
        while pending and pending[0][1] <= step_no:
            rid, _, prompt, max_tokens, priority = pending.pop(0)
            with contextlib.suppress(ValueError):
                sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens), float(step_no), priority))
        if not pending and not sched.has_unfinished_requests():
            break
        decodes = [r for r in sched.running if r.num_output_tokens > 0 and not r.is_prefill]
        out = sched.schedule()
        action = out.policy_actions.get("slo_budget")
        budget = action["budget"] if action else cfg.max_num_batched_tokens
        assert out.total_num_scheduled_tokens <= budget <= cfg.max_num_batched_tokens
        if action is not None and not out.preempted_req_ids:
            assert budget >= len(decodes)
        _block_accounting(sched)
        sched.update_from_output(out, runner.execute_model(out))
        if out.predicted_step is not None:
            sched.observe_step_time(out, factors[step_no % len(factors)] * out.predicted_step[0])
    else:
        raise AssertionError("trace did not drain: some request never finished")
    assert_scheduler_empty(sched)
    c = sched.slo_budget.correction
    for high in (False, True):
        assert all(MIN_FACTOR <= f <= MAX_FACTOR for f in c.factors(high))
