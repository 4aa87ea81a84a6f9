"""Replay tokenloom step traces through vLLM's REAL V1 scheduler (the conformance oracle).

Run it with the python of a vLLM install (0.32), from a directory that does not shadow packages:

    cd /tmp && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
        ~/.cache/tokenloom-anchors/vllm-venv/bin/python \\
        /path/to/tokenloom/benchmarks/vllm_conformance/vllm_replay.py TRACE.json [-o STEPS.json] [--model-dir DIR]

    # many traces in one process (vLLM's import takes seconds):
    ... vllm_replay.py --batch IN.json -o OUT.json     # IN: [TRACE, ...] -> OUT: [STEPS | {"error": ...}, ...]

It reads tokenloom's TRACE.json format (tokenloom/core/replay.py) and writes the same STEPS.json
format, driving `vllm.v1.core.sched.scheduler.Scheduler` with no model: every request whose
num_computed_tokens (after schedule) reached its num_tokens samples token id 7.

The scheduler is built the way vLLM's own tests do (tests/v1/core/utils.py `create_scheduler`):
VllmConfig(SchedulerConfig, ModelConfig from a local HF dir, CacheConfig), a KVCacheConfig with one
FullAttentionSpec group (num_kv_heads 1, head_size 1) and `num_blocks + 1` blocks, because vLLM's
BlockPool takes block 0 as its null block, so `num_blocks` stay usable, as in tokenloom.

Deliberate difference, mirrored here: tokenloom refuses impossible requests in
`Scheduler.add_request` (see `_reject_reason`); vLLM does that validation in its input processor,
before the scheduler, and its scheduler would spin forever on a request the pool can never hold.
The same rules are applied here so both sides schedule the same request set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

# The HF dir of SmolLM2-135M-Instruct (its config and tokenizer): --model-dir; compare.py passes
# $TOKENLOOM_ANCHORS_DIR/smollm2-hf. This script runs under vLLM's python, without tokenloom.envs.
DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/tokenloom-anchors/smollm2-hf")
REPLAY_TOKEN_ID = 7
_KNOWN_KEYS = {
    "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold",
    "policy", "max_model_len", "watermark", "scheduler_reserve_full_isl", "batching",
    "block_size", "num_blocks", "enable_prefix_caching",
}
# tokenloom's defaults (tokenloom/config.py), used when a trace leaves a knob out.
_DEFAULTS = {
    "max_num_batched_tokens": 2048, "max_num_seqs": 128, "max_model_len": 2048, "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0, "policy": "fcfs", "watermark": 0.0, "scheduler_reserve_full_isl": True,
    "batching": "continuous", "block_size": 16, "enable_prefix_caching": True,
}


class InvalidTrace(ValueError):
    """A trace vLLM's own config validation refuses (invalid on both sides)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_model_config_cache: dict[int, Any] = {}


def _model_config(model_dir: str, max_model_len: int) -> Any:
    from vllm.config import ModelConfig

    if max_model_len not in _model_config_cache:
        _model_config_cache[max_model_len] = ModelConfig(
            model=model_dir,
            tokenizer=model_dir,
            trust_remote_code=False,
            dtype="float32",
            seed=42,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
        )
    return _model_config_cache[max_model_len]


def build_scheduler(cfg: dict[str, Any], model_dir: str = DEFAULT_MODEL_DIR) -> Any:
    import copy

    import torch
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if cfg["batching"] != "continuous":
        raise InvalidTrace("vLLM has only continuous batching")
    # tokenloom's own config rules that vLLM lacks (tokenloom/config.py); under them every request
    # would be refused anyway, so the trace is declared invalid on both sides.
    if cfg["num_blocks"] < 1 or cfg["max_model_len"] < 2:
        raise InvalidTrace("tokenloom needs num_blocks >= 1 and max_model_len >= 2")
    try:
        scheduler_config = SchedulerConfig(
            max_num_seqs=cfg["max_num_seqs"],
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            max_model_len=cfg["max_model_len"],
            long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
            enable_chunked_prefill=cfg["enable_chunked_prefill"],
            policy=cfg["policy"],
            watermark=cfg["watermark"],
            scheduler_reserve_full_isl=cfg["scheduler_reserve_full_isl"],
            is_encoder_decoder=False,
            async_scheduling=False,
        )
    except (ValueError, TypeError) as exc:  # pydantic ValidationError is a ValueError
        raise InvalidTrace(f"vLLM SchedulerConfig refuses it: {exc}") from exc
    model_config = copy.deepcopy(_model_config(model_dir, cfg["max_model_len"]))
    cache_config = CacheConfig(
        block_size=cfg["block_size"],
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=cfg["enable_prefix_caching"],
    )
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    num_blocks = cfg["num_blocks"] + 1  # + vLLM's null block
    spec = FullAttentionSpec(block_size=cfg["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=cfg["block_size"],
        log_stats=False,
    )
    # VllmConfig.__post_init__ (platform hooks) may rewrite knobs: make sure it did not.
    sc = scheduler.scheduler_config
    actual = {
        "max_num_seqs": scheduler.max_num_running_reqs,
        "max_num_batched_tokens": scheduler.max_num_scheduled_tokens,
        "max_model_len": scheduler.max_model_len,
        "long_prefill_token_threshold": sc.long_prefill_token_threshold,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "policy": scheduler.policy.value,
        "watermark": sc.watermark,
        "scheduler_reserve_full_isl": scheduler.scheduler_reserve_full_isl,
        "block_size": scheduler.block_size,
        "enable_prefix_caching": scheduler.cache_config.enable_prefix_caching,
    }
    for key, value in actual.items():
        if value != cfg[key]:
            raise RuntimeError(f"vLLM rewrote {key}: trace {cfg[key]!r}, scheduler uses {value!r}")
    if scheduler.max_num_active_reqs != cfg["max_num_seqs"] or sc.long_prefill_token_threshold_adaptive:
        raise RuntimeError("unexpected max_num_active_seqs / adaptive threshold")
    if scheduler.num_lookahead_tokens or scheduler.num_spec_tokens or scheduler.num_prefill_lookahead:
        raise RuntimeError("unexpected speculative lookahead")
    if scheduler.kv_cache_manager.block_pool.get_num_free_blocks() != cfg["num_blocks"]:
        raise RuntimeError("pool size mismatch")
    return scheduler


def _reject_reason(prompt_len: int, max_tokens: int, cfg: dict[str, Any]) -> str | None:
    """tokenloom's rejection rules (tokenloom/core/scheduler.py Scheduler._validate), mirrored.

    vLLM validates prompt length in its input processor (vllm/v1/engine/input_processor.py), not in
    the scheduler, and has no "can never fit the pool" check at all (the scheduler would preempt the
    request forever). Applying tokenloom's rules here keeps the compared request sets identical.
    """
    if prompt_len == 0:
        return "The decoder prompt cannot be empty"
    if prompt_len >= cfg["max_model_len"]:
        return "prompt leaves no room to generate within max_model_len"
    final_len = min(prompt_len + max_tokens, cfg["max_model_len"])
    if cdiv(final_len - 1, cfg["block_size"]) > cfg["num_blocks"]:
        return "could never fit the KV pool"
    return None


def replay(trace: dict[str, Any], model_dir: str = DEFAULT_MODEL_DIR, max_steps: int = 1_000_000) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    unknown = sorted(set(trace["config"]) - _KNOWN_KEYS)
    if unknown:
        raise InvalidTrace(f"unknown config key(s): {unknown}")
    cfg = {**_DEFAULTS, **trace["config"]}
    scheduler = build_scheduler(cfg, model_dir)
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(cfg["block_size"], sha256)

    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in trace["requests"]:
        if int(r.get("arrival_step", 0)) < 0:
            raise InvalidTrace("arrival_step must be >= 0 (tokenloom's trace rule)")
        by_step.setdefault(int(r.get("arrival_step", 0)), []).append(r)
    last_arrival = max(by_step, default=-1)

    steps: list[dict[str, Any]] = []
    rejected: list[str] = []
    reasons: dict[str, str] = {}
    num_preempted = 0
    arrival_seq = 0
    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        if step >= max_steps:
            raise RuntimeError(f"replay did not finish within {max_steps} steps")
        for r in by_step.get(step, ()):
            rid = str(r["id"])
            prompt = [int(t) for t in r["prompt_token_ids"]]
            max_tokens = int(r["max_tokens"])
            if rid in scheduler.requests:
                reason: str | None = "request id is already in use"
            else:
                reason = _reject_reason(len(prompt), max_tokens, cfg)
            if reason is not None:
                rejected.append(rid)
                reasons[rid] = reason
                continue
            arrival_seq += 1
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            scheduler.add_request(
                Request(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    pooling_params=None,
                    # Strictly increasing in arrival order: the FCFS order and the priority tie-break.
                    arrival_time=float(arrival_seq),
                    priority=int(r.get("priority", 0)),
                    block_hasher=block_hasher,
                )
            )

        # Who is waiting before the step: a request admitted in this step leaves that set.
        waiting_before = {rid for rid, req in scheduler.requests.items() if req.status != RequestStatus.RUNNING}
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            sampled.append([REPLAY_TOKEN_ID] if req.num_computed_tokens >= req.num_tokens else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        # cached_tokens: the prefix hit of each request admitted in this step, i.e. its
        # num_computed_tokens at admission (schedule() already added the scheduled tokens).
        cached = {
            rid: scheduler.requests[rid].num_computed_tokens - n
            for rid, n in output.num_scheduled_tokens.items()
            if rid in waiting_before
        }
        engine_outputs = scheduler.update_from_output(output, runner_output)
        finished = [
            o.request_id for eco in engine_outputs.values() for o in eco.outputs if o.finish_reason is not None
        ]
        preempted = sorted(output.preempted_req_ids)
        num_preempted += len(preempted)
        steps.append(
            {
                "step": step,
                "scheduled": dict(output.num_scheduled_tokens),
                "preempted": preempted,
                "finished": finished,
                "num_free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                # Insertion order as tokenloom's: the order of admission.
                "cached_tokens": cached,
            }
        )
        step += 1

    total_tokens = sum(sum(s["scheduled"].values()) for s in steps)
    return {
        "steps": steps,
        "summary": {
            "rejected": rejected,
            "rejection_reasons": reasons,
            "num_steps": len(steps),
            "total_scheduled_tokens": total_tokens,
            "num_preemptions": num_preempted,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="TRACE.json, or with --batch a JSON list of traces")
    parser.add_argument("-o", "--output", help="write STEPS.json here (default: stdout)")
    parser.add_argument("--batch", action="store_true", help="the input is a list of traces; output a list")
    parser.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    args = parser.parse_args(argv)

    import logging

    logging.disable(logging.WARNING)
    with open(args.trace) as f:
        data = json.load(f)
    if args.batch:
        result: Any = []
        for trace in data:
            try:
                result.append(replay(trace, args.model_dir))
            except InvalidTrace as exc:
                result.append({"invalid": str(exc)})
            except Exception as exc:  # report, keep going: one bad trace must not sink the batch
                result.append({"error": f"{type(exc).__name__}: {exc}"})
    else:
        result = replay(data, args.model_dir)
    text = json.dumps(result, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
