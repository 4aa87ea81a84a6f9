"""The SLO budget controller (tokenloom/core/slo_budget.py, --target-itl-ms / --target-ttft-ms): the budget
it picks on hand-made states, that it is off by default, its configuration errors, deterministic
replays, and, over random traces, the scheduler's invariants with the controller on."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sched_utils import (
    PINNED_SIM_PROFILE,
    assert_scheduler_empty,
    create_requests,
    decodes_then_long_prompt,
    step,
)
from tests.test_scheduler_properties import _block_accounting
from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig
from tokenloom.core.cost_model import CostModel, StepShape, load_step_cost_model
from tokenloom.core.replay import replay
from tokenloom.core.replay_runner import ReplayRunner
from tokenloom.core.request import Request
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.sampling_params import SamplingParams

# 10 ms a step plus 1 ms a token: easy to work out by hand.
COST = CostModel({"overhead": 0.010, "prefill_tokens": 0.001, "decode_tokens": 0.001})


def _scheduler(ceiling: int = 256, **knobs):
    cfg = SchedulerConfig(max_num_batched_tokens=ceiling, max_num_seqs=64, max_model_len=1024,
                          slo_clock="predicted", **knobs)
    return make_scheduler(cfg, CacheConfig(block_size=16, num_blocks=4000), clock=lambda: 0.0, step_cost_model=COST)


def _decodes_and_a_prompt(num_decodes: int = 10, max_tokens: int = 500, warmup: int = 0, **knobs):
    """`num_decodes` one-token prompts start decoding; after `warmup` more steps a 200-token prompt arrives."""
    sched = _scheduler(**knobs)
    for r in create_requests(num_decodes, num_tokens=1, max_tokens=max_tokens, ignore_eos=True, prefix="d"):
        sched.add_request(r)
    out, _ = step(sched)
    assert "slo_budget" not in out.policy_actions  # no decodes yet: no gap at stake, the ceiling
    for _ in range(warmup):
        step(sched)
    sched.add_request(Request("p", [5] * 200, SamplingParams(max_tokens=4, ignore_eos=True)))
    return sched


def test_itl_target_shrinks_the_budget() -> None:
    # 10 decodes: a 40-token step is predicted at 50 ms, the largest within a 50.5 ms target. The prompt
    # gets the 30 tokens the decodes leave, not all its 200 as under the 256-token ceiling.
    sched = _decodes_and_a_prompt(target_itl_ms=50.5)
    out, _ = step(sched)
    assert out.num_scheduled_tokens["p"] == 30 and out.total_num_scheduled_tokens == 40
    assert out.policy_actions["slo_budget"] == {"budget": 40, "why": "itl", "predicted_ms": 50.0}


def test_without_the_controller_the_prompt_takes_the_ceiling() -> None:
    sched = _decodes_and_a_prompt()
    out, _ = step(sched)
    assert out.num_scheduled_tokens["p"] == 200 and not out.policy_actions


def test_budget_grows_back_when_the_decodes_finish() -> None:
    sched = _decodes_and_a_prompt(max_tokens=3, target_itl_ms=50.5)
    got = []
    for _ in range(4):
        out, _ = step(sched)
        got.append((out.num_scheduled_tokens.get("p", 0), "slo_budget" in out.policy_actions))
    # Two steps while the decodes run (their 2nd and 3rd tokens), then the ceiling for what is left.
    assert got[:3] == [(30, True), (30, True), (140, False)]


def test_decodes_alone_over_the_target_keep_their_tokens() -> None:
    # 60 decodes are predicted at 70 ms: over a 50 ms target, but the controller never pushes a decode
    # out of a step; the prompt waits for budget.
    sched = _decodes_and_a_prompt(num_decodes=60, target_itl_ms=50)
    out, _ = step(sched)
    assert "p" not in out.num_scheduled_tokens and out.total_num_scheduled_tokens == 60
    assert out.policy_actions["slo_budget"] == {"budget": 60, "why": "itl", "predicted_ms": 70.0}


def test_ttft_target_raises_one_step_for_a_prompt_at_risk() -> None:
    # At the ITL budget (40) the 200-token prompt needs 7 steps of 50 ms: 350 ms, over a 300 ms TTFT
    # target. After 100 steps of 10 decodes (1,000 gaps within the target) the 1 % allowance pays for one
    # step over the ITL target: large enough that the steps after it, back at the ITL budget, finish the
    # prompt in time.
    sched = _decodes_and_a_prompt(warmup=100, target_itl_ms=50.5, target_ttft_ms=300)
    controller = sched.slo_budget
    arrived = controller.arrival["p"]
    out, _ = step(sched)
    action = out.policy_actions["slo_budget"]
    assert action["why"] == "ttft" and 40 < action["budget"] < 256
    whys = []
    while sched.requests["p"].first_token_time is None:
        out, _ = step(sched)
        whys.append(out.policy_actions.get("slo_budget", {}).get("why"))
    assert whys[0] == "itl" and "ttft" not in whys  # the allowance is spent: back to the ITL budget
    assert controller.predicted_now - arrived <= 0.300


def test_ttft_target_feeds_a_prompt_near_its_deadline_when_the_decodes_alone_miss_the_itl_target() -> None:
    # 60 decodes are predicted at 70 ms, over the 50 ms ITL target: every step misses it whatever the
    # budget, so those misses do not spend the 1 % allowance, and the prompt (which the ITL budget leaves
    # nothing) is not starved until the decodes finish: it waits while the ceiling could still serve it
    # in time, then gets its tokens, its first one within the 1 s TTFT target.
    sched = _decodes_and_a_prompt(num_decodes=60, target_itl_ms=50, target_ttft_ms=1000)
    controller = sched.slo_budget
    arrived = controller.arrival["p"]
    got = []
    while sched.requests["p"].first_token_time is None:
        out, _ = step(sched)
        got.append((out.num_scheduled_tokens.get("p", 0), out.policy_actions.get("slo_budget", {}).get("why")))
        assert len(got) < 50, "the prompt starved"
    # Nothing while the ceiling could still serve it in time, then steps past the ITL budget (up to the
    # ceiling, where the controller does not act).
    assert got[:6] == [(0, "itl")] * 6 and all(why in ("ttft", None) for n, why in got if n)
    assert controller.predicted_now - arrived <= 1.0
    assert controller.num_gaps_over == 0  # none of those misses was the controller's choice


def test_ttft_target_does_not_spend_the_allowance_before_it_is_earned() -> None:
    sched = _decodes_and_a_prompt(target_itl_ms=50.5, target_ttft_ms=300)
    out, _ = step(sched)
    assert out.policy_actions["slo_budget"]["why"] == "itl"


def test_off_by_default_and_validated(tmp_path: Path) -> None:
    cfg = SchedulerConfig()
    assert cfg.target_itl_ms == 0 and cfg.target_ttft_ms == 0 and not cfg.slo_targets
    assert make_scheduler(cfg, CacheConfig(num_blocks=100)).slo_budget is None
    with pytest.raises(ConfigError, match="target_ttft_ms needs target_itl_ms"):
        SchedulerConfig(target_ttft_ms=500)
    with pytest.raises(ConfigError, match="target_itl_ms must be a number"):
        SchedulerConfig(target_itl_ms=-1)
    with pytest.raises(ConfigError, match="slo_clock"):
        SchedulerConfig(target_itl_ms=50, slo_clock="wall")
    with pytest.raises(ConfigError, match="batching='continuous'"):
        SchedulerConfig(target_itl_ms=50, batching="static")
    with pytest.raises(ConfigError, match="step_cost_profile"):
        make_scheduler(SchedulerConfig(target_itl_ms=50), CacheConfig(num_blocks=100))
    with pytest.raises(ConfigError, match="step_cost_profile .*cannot read"):
        make_scheduler(SchedulerConfig(target_itl_ms=50, step_cost_profile=str(tmp_path / "none.json")),
                       CacheConfig(num_blocks=100))
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match="not a tokenloom profile"):
        load_step_cost_model(tmp_path / "bad.json")


def test_shipped_profile_is_the_simulators_step_model() -> None:
    from tokenloom.sim.profile import SHIPPED_PROFILES, load_profile

    path = Path(__file__).resolve().parents[1] / "tokenloom/sim/profiles" / SHIPPED_PROFILES["default"]
    shape = StepShape.of_rows([(100, 1, True)] * 8 + [(0, 300, False)])
    assert load_step_cost_model(path).predict(shape) == pytest.approx(load_profile("default").step_model.predict(shape))


def _profile_file(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "tokenloom-sim-profile/1", "coefficients_s": COST.coefficients}))
    return str(path)


def test_replay_with_the_predicted_clock_is_deterministic_and_records_why(tmp_path: Path) -> None:
    trace = decodes_then_long_prompt({"max_num_batched_tokens": 128, "max_num_seqs": 32, "max_model_len": 512,
                                      "block_size": 16, "num_blocks": 400}, 10, 30, 300)
    default = replay(trace)
    assert all("policy" not in s for s in default["steps"])
    slo = {**trace, "config": {**trace["config"], "target_itl_ms": 40.5, "target_ttft_ms": 400,
                               "slo_clock": "predicted", "step_cost_profile": _profile_file(tmp_path)}}
    first, second = replay(slo), replay(slo)
    assert first == second
    acted = [s["policy"]["slo_budget"] for s in first["steps"] if "policy" in s]
    assert acted and all(a["budget"] == 30 and a["why"] == "itl" for a in acted)
    # 30-token steps while the decodes run: the long prompt takes longer than under the fixed budget.
    done = lambda steps: next(s["step"] for s in steps if "long" in s["finished"])  # noqa: E731
    assert done(first["steps"]) > done(default["steps"])


def test_simulated_itl_p99_meets_the_target() -> None:
    """The pinned profile on a virtual clock: chats plus documents; the default budget's step with a
    document chunk is far over 150 ms, the controller's ITL p99 is within it."""
    import numpy as np

    from tokenloom.sim.profile import load_profile
    from tokenloom.sim.simulate import simulate
    from tokenloom.workload.datasets import BenchRequest

    rng = np.random.default_rng(0)
    reqs, t = [], 0.0
    for i in range(30):
        t += float(rng.exponential(0.5))
        n = 2000 if i % 4 == 3 else int(rng.integers(100, 400))
        reqs.append(BenchRequest(f"r{i}", [int(x) for x in rng.integers(100, 40000, n)], n, 64, True, t))
    profile = load_profile(PINNED_SIM_PROFILE)
    cache = CacheConfig(block_size=16, num_blocks=20000)

    def itl_p99(trace: io.StringIO | None = None, **knobs) -> float:
        cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096, **knobs)
        res = simulate(reqs, cfg, cache, profile.step_model, trace=trace)
        return float(np.percentile([x for r in res.records for x in r.itl_s], 99))

    assert itl_p99() > 0.5
    trace = io.StringIO()
    assert itl_p99(trace, target_itl_ms=150) <= 0.150 + 1e-6
    # The step trace shows the controller's budget as the step's budget, and why.
    records = [json.loads(line) for line in trace.getvalue().splitlines()]
    acted = [r for r in records if "policy" in r]
    assert acted and all(r["budget"] == r["policy"]["slo_budget"]["budget"] < 2048 for r in acted)
    assert all(r["budget_used"] <= r["budget"] for r in records)


def test_explorer_preset_shows_the_budget_the_target_allows() -> None:
    from tokenloom.explore.presets import PRESETS
    from tokenloom.explore.scenario import run_scenario

    knobs = next(p["knobs"] for p in PRESETS if p["id"] == "slo-budget")
    default, slo = run_scenario({**knobs, "itl_target": 0}), run_scenario(knobs)
    assert default["prefill_done"] == {"p": 2} and slo["prefill_done"] == {"p": 4}
    steps = slo["steps"][slo["setup_steps"]:]
    assert [s["scheduled"].get("p", 0) for s in steps[:5]] == [6, 6, 6, 6, 1]  # then it decodes
    assert steps[0]["budget"] == 16 and steps[0]["policy"]["slo_budget"]["why"] == "itl"
    with pytest.raises(ConfigError, match="itl_target"):
        run_scenario({**knobs, "itl_target": -1})


# ---------------------------------------------------------------------------------------- properties
# A cost model linear in the step's tokens: the controller's walk is then an exact upper bound of the
# step the scheduler builds (KV shortages and prefix-cache hits only schedule fewer tokens).
LINEAR = CostModel({"overhead": 0.005, "prefill_tokens": 0.001, "decode_tokens": 0.001})


@st.composite
def _slo_traces(draw):
    budget = draw(st.integers(8, 64))
    config = {
        "max_num_batched_tokens": budget,
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_model_len": 128,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 4, 16])),
        "target_itl_ms": draw(st.sampled_from([6.5, 10.5, 20.5, 40.5])),
        "target_ttft_ms": draw(st.sampled_from([0, 0, 30, 100])),
        "slo_clock": "predicted",
        "max_prefill_wait_steps": draw(st.sampled_from([0, 0, 3])),
        "min_prefill_chunk": 1,
    }
    if config["policy"] == "priority":
        config["enable_priority_preemption"] = draw(st.booleans())
    cache = {"block_size": draw(st.sampled_from([2, 4, 8])), "num_blocks": draw(st.integers(16, 80)),
             "enable_prefix_caching": draw(st.booleans())}
    requests = [
        (f"r{i}", draw(st.integers(0, 15)), draw(st.lists(st.integers(0, 3), min_size=1, max_size=60)),
         draw(st.integers(1, 25)), draw(st.integers(0, 3)))
        for i in range(draw(st.integers(1, 10)))
    ]
    return config, cache, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_slo_traces())
def test_controller_keeps_the_invariants_and_the_itl_target(trace) -> None:
    config, cache, requests = trace
    cfg = SchedulerConfig(**config)
    sched = make_scheduler(cfg, CacheConfig(**cache), clock=lambda: 0.0, step_cost_model=LINEAR)
    runner = ReplayRunner(sched)
    target = cfg.target_itl_ms / 1000.0
    pending = sorted(requests, key=lambda r: (r[1], r[0]))
    for step_no in range(3000):
        while pending and pending[0][1] <= step_no:
            rid, _, prompt, max_tokens, priority = pending.pop(0)
            with contextlib.suppress(ValueError):  # can never fit this pool: rejected, as without the controller
                sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens), float(step_no), priority))
        if not pending and not sched.has_unfinished_requests():
            break
        decodes = [r for r in sched.running if r.num_output_tokens > 0 and not r.is_prefill]
        out = sched.schedule()
        action = out.policy_actions.get("slo_budget")
        budget = action["budget"] if action else cfg.max_num_batched_tokens
        assert out.total_num_scheduled_tokens <= budget <= cfg.max_num_batched_tokens
        if action is not None and not out.preempted_req_ids:
            assert budget >= len(decodes)  # never below the decodes' own tokens
        # The guarantee: with decodes running, a step is predicted within the ITL target whenever the
        # decodes alone are, except a TTFT step (spent from the 1 % allowance).
        shape = StepShape(prefill_tokens=out.total_num_scheduled_tokens)
        alone = StepShape(decode_tokens=len(decodes))
        if decodes and LINEAR.predict(alone) <= target and not (action and action["why"] == "ttft") \
                and not out.preempted_req_ids:
            assert LINEAR.predict(shape) <= target + 1e-9
        if out.preempted_req_ids:
            assert not out.scheduled_new_reqs, "a step that preempted admitted someone"
        _block_accounting(sched)
        sched.update_from_output(out, runner.execute_model(out))
        _block_accounting(sched)
    else:
        raise AssertionError("trace did not drain: some request never finished")
    assert_scheduler_empty(sched)
    assert sched.slo_budget is not None and not sched.slo_budget.arrival  # nothing remembered after a drain
