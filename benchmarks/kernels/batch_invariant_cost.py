"""What VLLM_BATCH_INVARIANT=1 costs: the same engine with and without it, side by side.

Each measurement runs in a fresh process with the variable set or not (the engine reads it at start),
the two modes alternated over repeats; medians and the invariant / default ratio per figure:

  prefill   one prompt of --prompt tokens, max_tokens=1: prompt tokens / s (TTFT)
  decode    one request, --decode tokens (ignore_eos): output tokens / s after the first
  batched   --batch requests of 64-128 prompt tokens, 64 output tokens each, all at once: output tokens / s

    .venv/bin/python benchmarks/kernels/batch_invariant_cost.py                       # the default model
    .venv/bin/python benchmarks/kernels/batch_invariant_cost.py --model qwen2.5-coder-0.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = {"default": "0", "invariant": "1"}


def child(args: argparse.Namespace) -> None:
    from tokenloom import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=max(16, args.batch)) if args.model else LLM(max_num_seqs=max(16, args.batch))
    tok = llm.get_tokenizer()
    words = "the river city market grew into a town where traders met every spring " * 400
    ids = tok.encode(words)
    out: dict[str, float] = {}
    llm.generate([{"prompt_token_ids": ids[:32]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    prompt = {"prompt_token_ids": ids[7 : 7 + args.prompt]}
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    out["prefill"] = args.prompt / (time.perf_counter() - t0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True)
    res = llm.generate([{"prompt_token_ids": ids[3:40]}], sp, use_tqdm=False)[0]
    m = res.metrics
    first, last = m.first_token_time, m.last_token_time
    out["decode"] = (args.decode - 1) / (last - first)
    prompts = [{"prompt_token_ids": ids[11 * i : 11 * i + 64 + (i * 17) % 64]} for i in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    out["batched"] = 64 * args.batch / (time.perf_counter() - t0)
    llm.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a model path or name (default: the embedded default model)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    cmd = [sys.executable, __file__, "--child", "--prompt", str(args.prompt), "--decode", str(args.decode),
           "--batch", str(args.batch)] + (["--model", args.model] if args.model else [])
    for r in range(args.repeats):
        for mode, flag in MODES.items():
            env = dict(os.environ, VLLM_BATCH_INVARIANT=flag)
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            line = next(s for s in run.stdout.splitlines() if s.startswith("RESULT "))
            results[mode].append(json.loads(line.removeprefix("RESULT ")))
            print(f"repeat {r} {mode}: {results[mode][-1]}", flush=True)
    print(f"\n{'figure':10s} {'default':>10s} {'invariant':>10s} {'ratio':>7s}")
    for fig in ("prefill", "decode", "batched"):
        a = statistics.median(x[fig] for x in results["default"])
        b = statistics.median(x[fig] for x in results["invariant"])
        print(f"{fig:10s} {a:10.1f} {b:10.1f} {b / a:7.2f}")


if __name__ == "__main__":
    main()
