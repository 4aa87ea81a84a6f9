"""`--quantization int8` on this CPU: the CPU kernels' int8 GEMM against oneDNN's, with float32 and the
GGUF default beside them, on the default model.

Each mode runs in a fresh process (the plan is made at load), the modes one after another in each round,
rounds alternating their order; a mode's figure is the median over rounds of its median over `--repeats`.
A round scores a `--prompt`-token prompt (prefill tok/s) and then decodes `--decode` tokens from a
16-token prompt (decode tok/s). `int8-onednn` makes the plan believe the CPU has VNNI, which is the plan
oneDNN's GEMM ran before the kernels' own (on a CPU with VNNI both int8 modes are oneDNN's).

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/quant/int8_gemm_paths.py [--rounds 2] \\
        [--modes int8-kernels,int8-onednn,float32,gguf] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODES = ("int8-kernels", "int8-onednn", "float32", "gguf")


def run_mode(mode: str, prompt_len: int, decode: int, repeats: int) -> dict[str, float]:
    from tokenloom.model import execution_plan

    if mode == "int8-onednn":
        execution_plan.cpu_has_fast_int8 = lambda: True
    from tokenloom import LLM, SamplingParams

    quantization = {"float32": "none", "gguf": None}.get(mode, "int8")
    llm = LLM(quantization=quantization, dtype="float32", max_model_len=max(1024, prompt_len + 16),
              enable_prefix_caching=False)
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    prefill, decoded = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill.append(prompt_len / (time.perf_counter() - t))
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt[:16]}], SamplingParams(max_tokens=decode, ignore_eos=True),
                     use_tqdm=False)
        decoded.append(decode / (time.perf_counter() - t))
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decoded)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args.prompt, args.decode, args.repeats)))
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--prompt", str(args.prompt),
                                  "--decode", str(args.decode), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, check=True)
            results[mode].append(json.loads(out.stdout.splitlines()[-1]))
            print(f"round {r + 1} {mode:12s} {results[mode][-1]}", flush=True)
    summary = {m: {k: statistics.median(x[k] for x in runs) for k in ("prefill_tok_s", "decode_tok_s")}
               for m, runs in results.items()}
    print(f"\n| mode | prefill, {args.prompt} tokens | decode |\n|---|---:|---:|")
    for mode, figures in summary.items():
        print(f"| {mode} | {figures['prefill_tok_s']:.1f} tok/s | {figures['decode_tok_s']:.1f} tok/s |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": results, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
