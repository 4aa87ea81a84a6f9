"""vLLM 0.32 scheduler behaviour around what its own scheduler tests (tests/peer/core) found missing, beyond what
those cases check: max_num_active_seqs and long_prefill_token_threshold_adaptive as engine arguments (LLM
keyword, CLI flag) with vLLM's checks."""

from __future__ import annotations

import argparse

import pytest

from tokenloom.config import CacheConfig, ConfigError, SchedulerConfig, engine_config_from_kwargs
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.engine.args import add_engine_args, engine_config_from_args
from tokenloom.sampling_params import SamplingParams


def _scheduler(**sched: object) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, **sched)
    return Scheduler(config, CacheConfig(block_size=4, num_blocks=64), clock=lambda: 0.0)


def test_the_two_knobs_are_engine_arguments_with_vllms_defaults_and_checks() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["m.gguf", "--max-num-seqs", "8", "--max-num-active-seqs", "3",
                              "--long-prefill-token-threshold", "16", "--long-prefill-token-threshold-adaptive"])
    config = engine_config_from_args(args)
    assert config == engine_config_from_kwargs(model="m.gguf", max_num_seqs=8, max_num_active_seqs=3,
                                               long_prefill_token_threshold=16,
                                               long_prefill_token_threshold_adaptive=True)
    assert config.scheduler.max_num_active_seqs == 3 and config.scheduler.long_prefill_token_threshold_adaptive
    default = SchedulerConfig()
    assert default.max_num_active_seqs is None and default.long_prefill_token_threshold_adaptive is False
    with pytest.raises(ConfigError, match=r"max_num_active_seqs \(9\) cannot be greater than max_num_seqs \(8\)"):
        engine_config_from_kwargs(max_num_seqs=8, max_num_active_seqs=9)
    with pytest.raises(ConfigError, match="max_num_active_seqs must be >= 1"):
        engine_config_from_kwargs(max_num_active_seqs=0)


def test_max_num_active_seqs_caps_admission_not_the_runner() -> None:
    scheduler = _scheduler(max_num_active_seqs=2)
    for i in range(4):
        scheduler.add_request(Request(str(i), [i] * 4, SamplingParams(max_tokens=4)))
    output = scheduler.schedule()
    assert [r.req_id for r in output.scheduled_new_reqs] == ["0", "1"] and output.bound_by == "max_num_seqs"
    assert scheduler.max_num_running_reqs == 8 and scheduler.max_num_active_reqs == 2
