"""Step time of tensor / pipeline parallelism on this machine: TP=1, TP=2 and PP=2 on one model.

Builds the engines once (`LLM(tensor_parallel_size=, pipeline_parallel_size=)`, the default model and
quantization unless told), then alternates rounds: in each round every engine runs a single-stream
decode (TPOT) and a batch of `--batch` prompts (output tokens/s), in turn, so the machine's load hits
all of them alike. Prints the median per engine and writes them with `--json`.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/parallel/step_time.py --rounds 3 \\
        --json docs/figures/parallel_step_time.json
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

import torch  # noqa: E402

from tokenloom import LLM, SamplingParams  # noqa: E402

CONFIGS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
# tp1-1thread: the tp1 engine run with one torch thread (what each rank of TP=2 / PP=2 has), to tell
# the effect of the split from that of one thread instead of two.
ONE_THREAD = "tp1-1thread"


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--configs", default="tp1,tp2,pp2", help=f"of tp1, tp2, pp2, {ONE_THREAD}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    kw = dict(max_model_len=512, kv_cache_memory=256 << 20)
    if args.quantization:
        kw["quantization"] = args.quantization
    names = args.configs.split(",")
    engines = {name: LLM(args.model, **kw, **CONFIGS[name]) for name in names if name != ONE_THREAD}
    if ONE_THREAD in names:
        engines[ONE_THREAD] = engines.get("tp1") or LLM(args.model, **kw)
    threads = torch.get_num_threads()
    prompt = [1 + (i * 37) % 1000 for i in range(32)]
    batch = [[1 + (i * 37 + j * 101) % 1000 for i in range(32)] for j in range(args.batch)]
    for llm in engines.values():  # warm-up: first-touch of the KV cache and kernels
        _run(llm, [prompt], 4)
    tpot: dict[str, list[float]] = {n: [] for n in engines}
    tput: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            torch.set_num_threads(1 if name == ONE_THREAD else threads)
            short, _ = _run(llm, [prompt], 1)
            full, n = _run(llm, [prompt], args.tokens + 1)
            tpot[name].append((full - short) / args.tokens * 1e3)
            seconds, n = _run(llm, batch, args.tokens)
            tput[name].append(n / seconds)
            print(f"round {r} {name}: TPOT {tpot[name][-1]:.1f} ms, batch of {args.batch}: {tput[name][-1]:.0f} tok/s",
                  flush=True)
    summary = {n: {"tpot_ms": statistics.median(tpot[n]), "batch_tok_s": statistics.median(tput[n])} for n in engines}
    for name, s in summary.items():
        print(f"{name}: TPOT {s['tpot_ms']:.1f} ms, batch of {args.batch} {s['batch_tok_s']:.0f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model or "SmolLM2-135M-Instruct (default GGUF)",
                                               "quantization": args.quantization or "default",
                                               "cpus": len(os.sched_getaffinity(0)), "rounds": args.rounds,
                                               "tokens": args.tokens, "batch": args.batch, "median": summary,
                                               "tpot_ms": tpot, "batch_tok_s": tput}, indent=1))
    for llm in {id(e): e for e in engines.values()}.values():
        llm.llm_engine.close()


if __name__ == "__main__":
    main()
