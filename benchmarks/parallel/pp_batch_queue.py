"""Pipeline parallel with M batches in flight (vLLM's batch queue) against one batch at a time.

One PP engine (the default model unless told). vLLM's scheduler puts every request that fits into
one step and never schedules a request with a step in flight, so micro-batches form only when the
requests start in different steps: the default token budget prefills 1 / pp of the requests per step,
so they start in pp groups that then decode in alternate steps (with the budget above all prompts, the
second batch in flight would be empty). Rounds alternate the engine
core's batch queue between the pipeline's depth (the default) and 1 (each step waits for the last
stage before the next is scheduled: tokenloom before issue 37's batch queue), so the machine's load
hits both alike. Prints medians of output tokens/s, and the executor's counts: steps in flight at once
and first-stage-ahead overlaps (the first stage finished batch N + 1 before the last finished N).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/parallel/pp_batch_queue.py --rounds 5 \\
        --json docs/figures/pp_batch_queue.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom import LLM, SamplingParams  # noqa: E402


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: the prompts' tokens / pp (one group of requests prefilled per step)")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    prompt_len = 32
    budget = args.max_num_batched_tokens or max(args.requests,
                                                prompt_len * args.requests // args.pipeline_parallel_size)
    kw = dict(max_model_len=512, kv_cache_memory=256 << 20, max_num_seqs=args.requests,
              max_num_batched_tokens=budget)
    if args.quantization:
        kw["quantization"] = args.quantization
    llm = LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size, **kw)
    core, executor = llm.llm_engine.engine_core, llm.llm_engine.executor
    depth = core.batch_queue_size
    prompts = [[1 + (i * 37 + j * 101) % 1000 for i in range(prompt_len)] for j in range(args.requests)]
    _run(llm, prompts[:2], 4)  # warm-up
    results: dict[str, list[float]] = {f"{depth} in flight": [], "1 in flight": []}
    overlaps = {name: 0 for name in results}
    for _ in range(args.rounds):
        for queue, name in ((depth, f"{depth} in flight"), (1, "1 in flight")):
            core.batch_queue_size = queue  # the engine core reads it at every step
            before = executor.pipeline_overlaps
            results[name].append(_run(llm, prompts, args.tokens))
            overlaps[name] += executor.pipeline_overlaps - before
        print({k: round(v[-1], 1) for k, v in results.items()}, flush=True)
    llm.llm_engine.close()
    summary = {
        "pipeline_parallel_size": args.pipeline_parallel_size, "requests": args.requests,
        "max_num_batched_tokens": budget, "tokens": args.tokens, "rounds": args.rounds,
        "load_average": os.getloadavg(),
        "tok_per_s_median": {k: statistics.median(v) for k, v in results.items()},
        "tok_per_s_rounds": results, "first_stage_ahead_overlaps": overlaps,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
