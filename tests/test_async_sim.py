"""Async scheduling in the simulator: the engine core's batch queue over the SimulatedExecutor, with
the AsyncScheduler's placeholders and, with speculative decoding, its K placeholder drafts that the
simulated runner fills itself (docs/async.md, "Simulator")."""

from __future__ import annotations

import io
import json

import pytest

from tests.test_spec_decode_sim import COST
from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig, SpeculativeConfig
from tokenloom.sim.simulate import simulate
from tokenloom.workload.datasets import random_requests

K = 4


def _run(async_scheduling: bool, acceptance: float | None, output_len: int = 48):
    reqs = random_requests(8, input_len=64, output_len=output_len, seed=1)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K) if acceptance is not None else None
    trace = io.StringIO()
    result = simulate(reqs, SchedulerConfig(max_model_len=512, async_scheduling=async_scheduling),
                      CacheConfig(num_blocks=512), COST, trace=trace, speculative_config=spec,
                      spec_acceptance=acceptance or 0.0, seed=0)
    return result, [json.loads(line) for line in trace.getvalue().splitlines()]


def test_async_sim_keeps_a_step_in_flight():
    sync, sync_steps = _run(False, None)
    result, steps = _run(True, None)
    assert result.metrics["completed"] == 8
    assert result.metrics["total_output_tokens"] == sync.metrics["total_output_tokens"] == 8 * 48
    assert all(s["in_flight"] == 0 for s in sync_steps)
    # Steady state: each step's output is processed while the next one is in flight.
    assert sum(s["in_flight"] == 1 for s in steps) > len(steps) // 2
    assert steps[-1]["kv_blocks_used"] == 0


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_async_spec_sim_fills_placeholder_drafts(acceptance):
    plain, _ = _run(True, None)
    result, steps = _run(True, acceptance)
    # max_tokens exactly (the late output of a request finished by accepted drafts is dropped).
    assert result.metrics["completed"] == 8
    assert result.metrics["total_output_tokens"] == 8 * 48
    assert steps[-1]["kv_blocks_used"] == 0
    # The AsyncScheduler schedules 1 + K per decoding request (K placeholder drafts) ...
    assert any(n == 1 + K for s in steps for n in s["scheduled"].values())
    # ... and the runner verifies real drafts in them: acceptance drives the step count as in sync.
    sync, _ = _run(False, acceptance)
    if acceptance == 0.0:
        assert result.num_steps >= plain.num_steps
    else:
        assert result.num_steps < plain.num_steps
        assert abs(result.num_steps - sync.num_steps) <= 0.2 * sync.num_steps
    accepted = sum(a for s in steps for _, a in (s.get("spec") or {}).values())
    assert (accepted == 0) == (acceptance == 0.0)


def test_async_sim_refuses_what_the_engine_refuses():
    reqs = random_requests(1, input_len=8, output_len=4, seed=1)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, adaptive=True)
    with pytest.raises(ConfigError, match="adaptive"):
        simulate(reqs, SchedulerConfig(max_model_len=64, async_scheduling=True), CacheConfig(num_blocks=64), COST,
                 speculative_config=spec)
