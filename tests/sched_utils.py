"""Helpers to drive the scheduler by hand in tests, the way vLLM's tests/v1/core/utils.py does."""

from __future__ import annotations

from pathlib import Path

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.scheduler_factory import make_scheduler
from tokenloom.sampling_params import SamplingParams

# A step-cost profile that stays put (the shipped default profile as of 2026-12-06, SmolLM2 bf16 on a 2-core
# AVX-512 EPYC): scenario tests of the simulator, the router and the SLO budget are tuned to its step times,
# while the shipped profile is re-measured on whatever machine profiles last (a 2x faster CPU halves every
# scenario's load).
PINNED_SIM_PROFILE = Path(__file__).resolve().parent / "sim_profile_pinned.json"

EOS_TOKEN_ID = 50256


def create_scheduler(
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    **kwargs,
) -> Scheduler:
    sched = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len or max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
        **kwargs,
    )
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching)
    return make_scheduler(sched, cache, clock=lambda: 0.0)


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    same_prompt: bool = False,
    priorities: list[int] | None = None,
    arrival_times: list[float] | None = None,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    prefix: str = "",
) -> list[Request]:
    requests = []
    for i in range(num_requests):
        params = SamplingParams(
            max_tokens=max_tokens, stop_token_ids=stop_token_ids, min_tokens=min_tokens, ignore_eos=ignore_eos
        )
        params.eos_token_id = EOS_TOKEN_ID
        prompt = [0 if same_prompt else i] * num_tokens
        requests.append(
            Request(
                f"{prefix}{i}",
                prompt,
                params,
                arrival_time=arrival_times[i] if arrival_times else float(i),
                priority=priorities[i] if priorities else 0,
            )
        )
    return requests


def runner_output(scheduler: Scheduler, output: SchedulerOutput, token: int = 42,
                  tokens: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
    """What a real runner returns: a token for each request whose computed tokens reached its length."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests.get(rid)
        if tokens and rid in tokens:
            sampled.append(list(tokens[rid]))
        elif req is not None and req.num_computed_tokens >= req.num_tokens:
            sampled.append([token])
        else:
            sampled.append([])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def step(scheduler: Scheduler, token: int = 42) -> tuple[SchedulerOutput, list]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner_output(scheduler, out, token))


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """After a drain nothing is owned, every block is free again (hashes may stay, lazily evicted)."""
    assert not scheduler.requests
    assert not scheduler.waiting
    assert not scheduler.running
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks and not kv.num_cached_block
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def decodes_then_long_prompt(config: dict, num_decodes: int, decode_max_tokens: int, long_len: int) -> dict:
    """A replay trace: `num_decodes` one-token prompts at step 0 (decoding from step 1) and a
    `long_len`-token prompt "long" arriving at step 2, for the policies that share the budget."""
    decodes = [{"id": f"d{i}", "arrival_step": 0, "prompt_token_ids": [i], "max_tokens": decode_max_tokens}
               for i in range(num_decodes)]
    long = {"id": "long", "arrival_step": 2, "prompt_token_ids": [99] * long_len, "max_tokens": 2}
    return {"config": config, "requests": decodes + [long]}
