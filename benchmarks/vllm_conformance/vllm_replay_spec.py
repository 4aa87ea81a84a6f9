"""Replay traces with speculative decoding and/or async scheduling through vLLM's REAL scheduler.

The extension of vllm_replay.py for shared/reference/replay-spec-async.md: config
`num_speculative_tokens` (K, n-gram sizing: no lookahead, no drafting slots) and `async_scheduling`;
per request `drafts` (sync proposer script) and `accept` (acceptor script). It drives
`vllm.v1.core.sched.scheduler.Scheduler` (sync) or `vllm.v1.core.sched.async_scheduler.AsyncScheduler`
(async, in the call order of EngineCore.step_with_batch_queue with a queue of 2) with the reference's
scripted runner and proposer, and writes the STEPS format with `spec`, `events`, `placeholders`,
`pending_drafts` and `summary.spec_decoding`, counted from vLLM's own SpecDecodingStats.

The scheduler is built with method "ngram" and async_scheduling off in the VllmConfig (vLLM's config
refuses an explicit async flag with the CPU n-gram proposer; the scheduler classes do not read it),
and the AsyncScheduler class is picked here, as the engine does for `ngram_gpu`.

Run with the python of a vLLM 0.32 install (or the unpacked wheel on PYTHONPATH with its deps):

    cd /tmp && PYTHONPATH=/work/vllm-src:/tmp/vdeps python .../vllm_replay_spec.py --batch IN.json -o OUT.json \\
        --model-dir DIR_WITH_A_LLAMA_CONFIG_JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections import deque
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_replay as base  # noqa: E402  (the sync harness: config defaults, rejection rules)

DRAFT_TOKEN_ID = 9
BATCH_QUEUE_SIZE = 2
_KNOWN_KEYS = base._KNOWN_KEYS | {"num_speculative_tokens", "async_scheduling"}


def build_scheduler(cfg: dict[str, Any], model_dir: str) -> Any:
    import torch
    from vllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        enable_chunked_prefill=cfg["enable_chunked_prefill"], policy=cfg["policy"], watermark=cfg["watermark"],
        scheduler_reserve_full_isl=cfg["scheduler_reserve_full_isl"], is_encoder_decoder=False,
        async_scheduling=False,
    )
    model_config = copy.deepcopy(base._model_config(model_dir, cfg["max_model_len"]))
    cache_config = CacheConfig(block_size=cfg["block_size"], gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=cfg["enable_prefix_caching"])
    k = cfg["num_speculative_tokens"]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=1,
                             prompt_lookup_min=1) if k > 0 else None
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config, speculative_config=spec)
    num_blocks = cfg["num_blocks"] + 1  # + vLLM's null block
    attn = FullAttentionSpec(block_size=cfg["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], attn)])
    cache_config.num_gpu_blocks = num_blocks
    cls = AsyncScheduler if cfg["async_scheduling"] else Scheduler
    scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                    structured_output_manager=StructuredOutputManager(vllm_config), block_size=cfg["block_size"],
                    log_stats=True)
    assert scheduler.num_spec_tokens == k and scheduler.num_lookahead_tokens == 0
    assert scheduler.max_num_scheduled_tokens == cfg["max_num_batched_tokens"]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == cfg["num_blocks"]
    return scheduler


class _Cycle:
    def __init__(self, values: list[int], default: int) -> None:
        self.values = list(values) or [default]
        self.cursor = 0

    def next(self) -> int:
        v = self.values[self.cursor % len(self.values)]
        self.cursor += 1
        return v


def replay(trace: dict[str, Any], model_dir: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    unknown = sorted(set(trace["config"]) - _KNOWN_KEYS)
    if unknown:
        raise base.InvalidTrace(f"unknown config key(s): {unknown}")
    cfg = {**base._DEFAULTS, "num_speculative_tokens": 0, "async_scheduling": False, **trace["config"]}
    k = cfg["num_speculative_tokens"]
    is_async = cfg["async_scheduling"]
    scheduler = build_scheduler(cfg, model_dir)
    init_none_hash(sha256)
    block_hasher = get_request_block_hasher(cfg["block_size"], sha256)
    drafts = {str(r["id"]): _Cycle(r.get("drafts") or [], k) for r in trace["requests"]}
    accept = {str(r["id"]): _Cycle(r.get("accept") or [], 0) for r in trace["requests"]}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in trace["requests"]:
        by_step.setdefault(int(r.get("arrival_step", 0)), []).append(r)
    last_arrival = max(by_step, default=-1)

    steps: list[dict[str, Any]] = []
    rejected: list[str] = []
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
              "num_accepted_tokens_per_pos": [0] * k}
    queue: deque[tuple[int, Any, Any]] = deque()
    arrival_seq = 0
    step = 0

    def run_batch(output: Any, waiting_before: set[str]) -> tuple[Any, dict[str, list[int]], dict[str, int]]:
        req_ids = list(output.num_scheduled_tokens)
        spec: dict[str, list[int]] = {}
        sampled = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            d = len(output.scheduled_spec_decode_tokens.get(rid, ()))
            a = 0
            if d and rid not in waiting_before:
                a = min(accept[rid].next(), d)
            if d:
                spec[rid] = [d, a]
            sampled.append([DRAFT_TOKEN_ID] * a + [base.REPLAY_TOKEN_ID])
        cached = {rid: scheduler.requests[rid].num_computed_tokens - n
                  for rid, n in output.num_scheduled_tokens.items() if rid in waiting_before}
        out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        return out, spec, cached

    def update(output: Any, runner_output: Any) -> list[str]:
        engine_outputs = scheduler.update_from_output(output, runner_output)
        finished = [o.request_id for eco in engine_outputs.values() for o in eco.outputs
                    if o.finish_reason is not None]
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats.spec_decoding_stats if eco.scheduler_stats else None
            if stats is not None:
                totals["num_drafts"] += stats.num_drafts
                totals["num_draft_tokens"] += stats.num_draft_tokens
                totals["num_accepted_tokens"] += stats.num_accepted_tokens
                for i, n in enumerate(stats.num_accepted_tokens_per_pos):
                    totals["num_accepted_tokens_per_pos"][i] += n
        return finished

    while True:
        for r in by_step.get(step, ()):
            rid = str(r["id"])
            prompt = [int(t) for t in r["prompt_token_ids"]]
            reason = ("request id is already in use" if rid in scheduler.requests
                      else base._reject_reason(len(prompt), int(r["max_tokens"]), cfg))
            if reason is not None:
                rejected.append(rid)
                continue
            arrival_seq += 1
            scheduler.add_request(Request(
                request_id=rid, prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=int(r["max_tokens"]), ignore_eos=True, temperature=0.0),
                pooling_params=None, arrival_time=float(arrival_seq), priority=int(r.get("priority", 0)),
                block_hasher=block_hasher))
        record: dict[str, Any] = {"step": step, "scheduled": {}, "preempted": [], "finished": [],
                                  "cached_tokens": {}}
        if is_async:
            if step > last_arrival and not scheduler.has_requests() and not queue:
                break
            events: list[str] = []
            spec: dict[str, list[int]] = {}
            pop = False
            popped_empty = True
            output = None
            if scheduler.has_requests():
                waiting_before = {rid for rid, q in scheduler.requests.items() if q.status != RequestStatus.RUNNING}
                output = scheduler.schedule()
                runner_output, spec, cached = run_batch(output, waiting_before)
                queue.append((step, output, runner_output))
                events.append("schedule")
                record.update(scheduled=dict(output.num_scheduled_tokens), preempted=sorted(output.preempted_req_ids),
                              cached_tokens=cached)
                pop = len(queue) >= BATCH_QUEUE_SIZE or (output.total_num_scheduled_tokens == 0
                                                         and not scheduler.has_unfinished_requests())
            elif queue:
                pop = True
            if pop:
                j, batch, runner_output = queue.popleft()
                popped_empty = batch.total_num_scheduled_tokens == 0
                record["finished"] = update(batch, runner_output)
                events.append(f"update:{j}")
            stuck = (output is not None and output.total_num_scheduled_tokens == 0 and not output.preempted_req_ids
                     and popped_empty and not record["finished"] and step >= last_arrival
                     and scheduler.has_unfinished_requests()
                     and all(b.total_num_scheduled_tokens == 0 for _, b, _ in queue))
            record["events"] = events
            record["placeholders"] = {rid: q.num_output_placeholders for rid, q in scheduler.requests.items()
                                      if q.num_output_placeholders}
        else:
            if not (step <= last_arrival or scheduler.has_unfinished_requests()):
                break
            waiting_before = {rid for rid, q in scheduler.requests.items() if q.status != RequestStatus.RUNNING}
            output = scheduler.schedule()
            runner_output, spec, cached = run_batch(output, waiting_before)
            record.update(scheduled=dict(output.num_scheduled_tokens), preempted=sorted(output.preempted_req_ids),
                          cached_tokens=cached)
            record["finished"] = update(output, runner_output)
            stuck = (output.total_num_scheduled_tokens == 0 and not output.preempted_req_ids
                     and not record["finished"] and step >= last_arrival and scheduler.has_unfinished_requests())
            if k > 0 and output.total_num_scheduled_tokens > 0:
                req_ids = list(output.num_scheduled_tokens)
                lists = []
                for rid in req_ids:
                    offered = drafts[rid].next()
                    q = scheduler.requests.get(rid)
                    room = cfg["max_model_len"] - q.num_tokens if q is not None else 0
                    lists.append([DRAFT_TOKEN_ID] * max(min(offered, k, room), 0))
                scheduler.update_draft_token_ids(DraftTokenIds(req_ids, lists))
        record["num_free_blocks"] = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        if k > 0:
            record["spec"] = spec
            record["pending_drafts"] = {rid: len(q.spec_token_ids) for rid, q in scheduler.requests.items()
                                        if q.spec_token_ids}
        steps.append(record)
        if stuck:  # a fixed point of the deterministic scheduler (the reference's stall detection)
            break
        step += 1
        if step > 100_000:
            raise RuntimeError("replay did not finish within 100000 steps")
    summary: dict[str, Any] = {"rejected": rejected, "num_steps": len(steps),
                               "total_scheduled_tokens": sum(sum(s["scheduled"].values()) for s in steps)}
    if k > 0:
        summary["spec_decoding"] = totals
    return {"steps": steps, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="TRACE.json, or with --batch a JSON list of traces")
    parser.add_argument("-o", "--output")
    parser.add_argument("--batch", action="store_true")
    parser.add_argument("--model-dir", default=base.DEFAULT_MODEL_DIR)
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)
    data = json.loads(Path(args.trace).read_text())
    if args.batch:
        result: Any = []
        for trace in data:
            try:
                result.append(replay(trace, args.model_dir))
            except Exception as exc:  # one bad trace must not sink the batch
                result.append({"error": f"{type(exc).__name__}: {exc}"})
    else:
        result = replay(data, args.model_dir)
    text = json.dumps(result, indent=1)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
