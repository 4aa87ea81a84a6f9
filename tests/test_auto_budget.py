"""The automatic token budget (no --max-num-batched-tokens): a step that carries decodes takes at most
auto_budget_prefill_ms of prompt work at the measured rate; an explicit budget is vLLM's fixed one.
Step times are injected (Scheduler.observe_step_time), never measured: nothing here depends on timing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.sched_utils import create_requests, runner_output
from tokenloom.config import (
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    engine_arg,
    engine_config_from_kwargs,
    parse_token_budget,
    token_budget_text,
)
from tokenloom.core.auto_budget import LEARN_MIN_PREFILL, MIN_CHUNK, AutoTokenBudget
from tokenloom.core.request import Request
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.sampling_params import SamplingParams


# --- configuration -------------------------------------------------------------------------------
def test_the_default_is_automatic_with_2048_as_its_ceiling() -> None:
    cfg = SchedulerConfig()
    assert cfg.max_num_batched_tokens is None
    assert cfg.token_budget_ceiling == 2048
    assert cfg.auto_token_budget
    assert "auto" in token_budget_text(cfg)
    # replace() (the engine sets max_model_len so) keeps it automatic
    assert replace(cfg, max_model_len=4096).auto_token_budget


@pytest.mark.parametrize("budget", [2048, 512, 8192])
def test_an_explicit_budget_is_fixed(budget: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=budget)
    assert not cfg.auto_token_budget
    assert cfg.token_budget_ceiling == budget
    assert token_budget_text(cfg) == f"token budget {budget}"
    sched = engine_config_from_kwargs(max_num_batched_tokens=budget).scheduler
    assert sched is not None and not sched.auto_token_budget
    # the CLI spelling: a number is explicit, "auto" is the default
    arg = engine_arg("max_num_batched_tokens")
    assert arg.parse(str(budget)) == budget and arg.parse("auto") is None and parse_token_budget(" AUTO ") is None


def test_what_turns_the_automatic_budget_off() -> None:
    assert not SchedulerConfig(auto_budget_prefill_ms=0).auto_token_budget
    assert not SchedulerConfig(batching="static").auto_token_budget
    slo = SchedulerConfig(target_itl_ms=200)  # the SLO controller owns the budget, under the same ceiling
    assert not slo.auto_token_budget and slo.token_budget_ceiling == 2048
    with pytest.raises(ConfigError, match="auto_budget_prefill_ms"):
        SchedulerConfig(auto_budget_prefill_ms=-1)
    # checks that read the budget use the ceiling when it is automatic
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(2048\) must be >= max_num_seqs"):
        SchedulerConfig(max_num_seqs=4096)


def test_no_engine_config_means_auto() -> None:
    assert engine_config_from_kwargs().scheduler is None  # the engine builds SchedulerConfig(): auto
    sched = engine_config_from_kwargs(max_num_seqs=8).scheduler
    assert sched is not None and sched.auto_token_budget


# --- the rule on its own --------------------------------------------------------------------------
def _decoding(rid: str, context: int) -> Request:
    r = Request(rid, list(range(context)), SamplingParams(max_tokens=100, ignore_eos=True))
    r.append_output_token_ids(7)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def _prompt(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=100, ignore_eos=True))


def test_the_rate_comes_from_steps_with_prompt_work() -> None:
    auto = AutoTokenBudget(ceiling=2048, target_s=2.0)
    assert auto.chunk() is None  # nothing measured: vLLM's ceiling
    auto.observe(prefill_tokens=LEARN_MIN_PREFILL - 1, total_tokens=40, seconds=5.0)  # decodes and overhead
    assert auto.chunk() is None
    auto.observe(prefill_tokens=2048, total_tokens=2048, seconds=10.24)  # 5 ms a token
    assert auto.seconds_per_token == pytest.approx(0.005)
    assert auto.chunk() == 400  # 2 s of prompt work
    auto.observe(prefill_tokens=400, total_tokens=400, seconds=1.0)  # faster now: 2.5 ms a token
    assert 0.0025 < auto.seconds_per_token < 0.005


def test_a_step_with_decodes_gets_the_decodes_plus_the_chunk() -> None:
    auto = AutoTokenBudget(ceiling=2048, target_s=2.0)
    auto.observe(2048, 2048, 10.24)  # 400 tokens in 2 s
    decodes = [_decoding(f"d{i}", 100) for i in range(7)]
    budget, why = auto.decide(decodes, [_prompt("p", 1000)], free_slots=10)
    assert budget == 7 + 400
    assert why == {"budget": 407, "chunk": 400, "ms_per_token": 5.0}
    # no decodes: no gap at stake, the ceiling
    assert auto.decide([], [_prompt("p", 3000)], free_slots=10) == (2048, None)
    # everything fits: the budget would not bind, nothing acts
    assert auto.decide(decodes, [_prompt("p", 300)], free_slots=10) == (2048, None)
    # no free slot: the waiting prompt cannot come in
    assert auto.decide(decodes, [_prompt("p", 3000)], free_slots=0) == (2048, None)


def test_the_chunk_never_falls_below_a_minimum_nor_a_padded_first_decode() -> None:
    slow = AutoTokenBudget(ceiling=2048, target_s=0.001)
    slow.observe(100, 100, 100.0)  # 1 s a token
    assert slow.chunk() == MIN_CHUNK
    spec = AutoTokenBudget(ceiling=2048, target_s=0.001, num_spec_tokens=MIN_CHUNK + 4)
    spec.observe(100, 100, 100.0)
    assert spec.chunk() == MIN_CHUNK + 5


def test_a_fast_machine_keeps_the_ceiling() -> None:
    fast = AutoTokenBudget(ceiling=2048, target_s=2.0)
    fast.observe(2048, 2048, 0.5)  # a 2,048-token step in 0.5 s: the rule never binds
    assert fast.decide([_decoding("d", 10)], [_prompt("p", 8000)], free_slots=4) == (2048, None)


# --- in the scheduler -----------------------------------------------------------------------------
def _scheduler(**kwargs):
    cfg = SchedulerConfig(max_model_len=4096, **kwargs)
    cache = CacheConfig(block_size=16, num_blocks=2000, enable_prefix_caching=False)
    return make_scheduler(cfg, cache, clock=lambda: 0.0)


def _run(scheduler, seconds_per_token: float) -> list:
    """Four 500-token prompts, then a 3,000-token one once they decode; each step reported as taking
    `seconds_per_token` per token. The steps' scheduled token counts."""
    for r in create_requests(4, num_tokens=500, max_tokens=20, ignore_eos=True):
        scheduler.add_request(r)
    totals, actions = [], []
    for i in range(6):
        if i == 1:
            scheduler.add_request(create_requests(1, num_tokens=3000, max_tokens=20, ignore_eos=True,
                                                  prefix="long")[0])
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(scheduler, out))
        scheduler.observe_step_time(out, seconds_per_token * out.total_num_scheduled_tokens)
        totals.append(out.total_num_scheduled_tokens)
        actions.append(out.policy_actions.get("auto_budget"))
    return list(zip(totals, actions))


def test_the_scheduler_bounds_steps_that_carry_decodes() -> None:
    steps = _run(_scheduler(auto_budget_prefill_ms=2000), seconds_per_token=0.005)  # 400 tokens in 2 s
    assert steps[0] == (2000, None)  # no decodes yet: the ceiling (everything fits)
    # step 1: the 4 decodes, the long prompt gets 2 s of prompt work
    assert steps[1] == (404, {"budget": 404, "chunk": 400, "ms_per_token": 5.0})
    assert all(total == 404 for total, _ in steps[2:])


def test_an_explicit_2048_keeps_vllm_s_fixed_budget() -> None:
    steps = _run(_scheduler(max_num_batched_tokens=2048), seconds_per_token=0.005)
    assert steps[0] == (2000, None)
    assert steps[1] == (4 + 2044, None) and steps[2] == (4 + 956, None)  # the long prompt in two chunks
    # the same with the rule turned off by --auto-budget-prefill-ms 0
    assert _run(_scheduler(auto_budget_prefill_ms=0), 0.005) == steps


def test_the_automatic_budget_is_vllm_s_until_a_step_time_is_reported() -> None:
    """Replays and the conformance traces report no step times: decisions are vLLM's at 2048."""
    a, b = _scheduler(), _scheduler(max_num_batched_tokens=2048)
    for s in (a, b):
        for r in create_requests(4, num_tokens=500, max_tokens=20, ignore_eos=True):
            s.add_request(r)
        s.add_request(create_requests(1, num_tokens=3000, max_tokens=20, ignore_eos=True, prefix="long")[0])
    for _ in range(5):
        outs = [s.schedule() for s in (a, b)]
        assert outs[0].num_scheduled_tokens == outs[1].num_scheduled_tokens
        for s, o in zip((a, b), outs):
            s.update_from_output(o, runner_output(s, o))


# --- in the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.tiny_models import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=3)


def test_the_engine_resolves_the_automatic_budget_and_says_so(tiny_dir, caplog) -> None:
    from tokenloom.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(40)]} for i in range(3)]
    with caplog.at_level("INFO", logger="tokenloom.engine"):  # the engine core logs it (core_host)
        auto = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4)
    engine = auto.llm_engine
    assert engine.scheduler_config.auto_token_budget and engine.scheduler.auto_budget is not None
    assert engine.scheduler.max_num_scheduled_tokens == 2048
    assert "token budget auto (at most 2048" in caplog.text
    auto.generate(prompts, params, use_tqdm=False)
    # the engine core reported its steps: the rate is measured (a tiny model: the rule does not bind)
    assert engine.scheduler.auto_budget.num_samples >= 1
    caplog.clear()
    with caplog.at_level("INFO", logger="tokenloom.engine"):  # the engine core logs it (core_host)
        fixed = LLM(str(tiny_dir), dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=2048)
    assert fixed.llm_engine.scheduler.auto_budget is None
    assert "token budget 2048" in caplog.text
    want = [o.outputs[0].token_ids for o in fixed.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, params, use_tqdm=False)] == want
