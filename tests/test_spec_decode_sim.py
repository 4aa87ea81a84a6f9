"""Speculative decoding in the simulator: verification rows in the cost model, an acceptance rate."""

from __future__ import annotations

import pytest

from tokenloom.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenloom.core.cost_model import CostModel, StepShape
from tokenloom.sim.simulate import simulate
from tokenloom.workload.datasets import random_requests

COST = CostModel({"overhead": 0.015, "gemm_rows": 5e-4, "prefill_attn": 2e-7, "decode_attn": 6e-7,
                  "num_samples": 1e-4})


def test_verification_rows_cost_a_chunk_and_its_output_rows():
    shape = StepShape()
    shape.add_row(100, 5, True, num_drafts=4)
    assert (shape.prefill_tokens, shape.num_samples, shape.prefill_attn) == (5, 5, 5 * 100 + 15)


def _run(acceptance: float | None, n: int = 8):
    reqs = random_requests(n, input_len=64, output_len=48, seed=1)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4) if acceptance is not None else None
    return simulate(reqs, SchedulerConfig(max_model_len=512), CacheConfig(num_blocks=512), COST,
                    speculative_config=spec, spec_acceptance=acceptance or 0.0, seed=0)


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_acceptance_rate_drives_steps_and_latency(acceptance):
    plain, spec = _run(None), _run(acceptance)
    assert spec.metrics["completed"] == plain.metrics["completed"] == 8
    assert spec.metrics["total_output_tokens"] == plain.metrics["total_output_tokens"]
    if acceptance == 0.0:  # drafts cost rows and give nothing back
        assert spec.num_steps == plain.num_steps
        assert spec.metrics["mean_tpot_ms"] > plain.metrics["mean_tpot_ms"]
    else:
        assert spec.num_steps < plain.num_steps
    if acceptance == 1.0:  # 5 tokens per verified step
        assert spec.metrics["mean_tpot_ms"] < plain.metrics["mean_tpot_ms"] / 2
