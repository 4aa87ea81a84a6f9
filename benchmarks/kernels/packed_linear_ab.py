"""oneDNN pre-packed linears vs F.linear on the default model, alternated in fresh processes.

Each round starts one process per setting (TOKENLOOM_PACKED_LINEAR=1, then 0, the order flipped
every round): 32 chat prompts x 48 greedy tokens in one generate call (output tok/s), then one
request of 64 tokens (ms a token). Medians over rounds; the outputs of the two settings are compared.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kernels/packed_linear_ab.py --rounds 2 [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from tokenloom import LLM, SamplingParams
llm = LLM(dtype=sys.argv[1])
p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
prompts = [f"Tell me about the number {i} and why it is interesting in mathematics." for i in range(32)]
llm.generate(prompts[:4], p, use_tqdm=False)
t = time.perf_counter(); out = llm.generate(prompts, p, use_tqdm=False); batched = time.perf_counter() - t
one = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
t = time.perf_counter(); single = llm.generate(prompts[:1], one, use_tqdm=False); dt = time.perf_counter() - t
print(json.dumps({"batched_tok_s": 32 * 48 / batched, "single_ms_per_token": dt / 64 * 1e3,
                  "texts": [o.outputs[0].text for o in out]}))
"""


def run(packed: bool, dtype: str) -> dict:
    env = dict(os.environ, TOKENLOOM_PACKED_LINEAR="1" if packed else "0")
    res = subprocess.run([sys.executable, "-c", CHILD, dtype], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"packed": [], "f.linear": []}
    for r in range(args.rounds):
        for packed in ((True, False) if r % 2 == 0 else (False, True)):
            key = "packed" if packed else "f.linear"
            t = time.perf_counter()
            res = run(packed, args.dtype)
            runs[key].append(res)
            print(f"round {r} {key:8s}: {res['batched_tok_s']:.0f} tok/s (32 x 48), "
                  f"single {res['single_ms_per_token']:.1f} ms/token ({time.perf_counter() - t:.0f} s)", flush=True)
    summary = {k: {"batched_tok_s": statistics.median(x["batched_tok_s"] for x in v),
                   "single_ms_per_token": statistics.median(x["single_ms_per_token"] for x in v)}
               for k, v in runs.items()}
    same = sum(a == b for a, b in zip(runs["packed"][0]["texts"], runs["f.linear"][0]["texts"], strict=True))
    summary["identical_texts"] = f"{same}/32"
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": {k: [{kk: vv for kk, vv in x.items() if kk != "texts"} for x in v]
                                                     for k, v in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
