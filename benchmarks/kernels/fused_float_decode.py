"""The fused decode step on the unquantized default model vs the per-op path, alternated in fresh processes.

Settings (each its own process, the order flipped every round):
  fp32 per-op   float32, oneDNN-packed linears (the default)
  fp32 fused    float32, TOKENLOOM_FUSED_FLOAT=1: layer weights plain, the fused step for <= 8 decode
                rows, F.linear above; the LM head packed
  bf16 per-op   bfloat16, TOKENLOOM_FUSED_DECODE_ROWS=0 (F.linear: oneDNN cannot pack bf16 on AVX2)
  bf16 fused    bfloat16 (the default where packing is unavailable)

Each process: RSS after start-up; decode ms a step at batch 1, 4 and 8 (greedy, ignore_eos: the time
of 8 + N tokens minus that of 8, over N steps, so prefill is excluded); W1-style batched throughput
(32 prompts x 48 tokens, tok/s); the greedy texts (compared across settings). `--lm-head` adds, in
each fused process, the LM head at M = 1, 4, 8: the model's (oneDNN packed) vs the decoder's
dense kernel on the plain embedding table (tied).

    PYTHONPATH=$PWD python benchmarks/kernels/fused_float_decode.py --rounds 1 [--only fp32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "fp32 per-op": ("float32", {}),
    "fp32 fused": ("float32", {"TOKENLOOM_FUSED_FLOAT": "1"}),
    "bf16 per-op": ("bfloat16", {"TOKENLOOM_FUSED_DECODE_ROWS": "0"}),
    "bf16 fused": ("bfloat16", {}),
}

CHILD = r"""
import json, sys, time
import torch
from tokenloom import LLM, SamplingParams
dtype, steps, lm_head = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
llm = LLM(dtype=dtype)
model = llm.llm_engine.runner.model
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
prompts = [f"Tell me about the number {i} and why it is interesting in mathematics." for i in range(32)]
def gen(n, tokens):
    p = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter(); out = llm.generate(prompts[:n], p, use_tqdm=False)
    return time.perf_counter() - t, out
gen(4, 8)
res = {"rss_mb": rss, "fused": model.fused_step is not None, "ms_per_step": {}}
for n in (1, 4, 8):
    short = min(gen(n, 8)[0] for _ in range(2))
    long, out = gen(n, 8 + steps)
    res["ms_per_step"][n] = (long - short) / steps * 1e3
    if n == 8:
        res["texts"] = [o.outputs[0].text for o in out]
t, _ = gen(32, 48)
res["w1_tok_s"] = 32 * 48 / t
if lm_head:
    from tokenloom.model.gguf_kernels import gguf_kernels
    k = gguf_kernels(); w = model.embed_tokens; res["lm_head_ms"] = {}
    for m in (1, 4, 8):
        x = torch.randn(m, w.shape[1]).to(model.dtype); out = torch.empty(m, w.shape[0])
        fs = {"model_head": lambda: model.compute_logits(x),
              "dense_kernel": lambda: k.dense_linear(out, x.float(), w, None)}
        best = {n: 1e9 for n in fs}
        for _ in range(5):
            for n, f in fs.items():
                t = time.perf_counter(); [f() for _ in range(5)]
                best[n] = min(best[n], (time.perf_counter() - t) / 5 * 1e3)
        res["lm_head_ms"][m] = best
print(json.dumps(res))
"""


def run(name: str, steps: int, lm_head: bool) -> dict:
    dtype, env = SETTINGS[name]
    keep = {k: v for k, v in os.environ.items() if k not in ("TOKENLOOM_FUSED_FLOAT", "TOKENLOOM_FUSED_DECODE_ROWS")}
    env = keep | env
    res = subprocess.run([sys.executable, "-c", CHILD, dtype, str(steps), "1" if lm_head else "0"], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    ap.add_argument("--only", choices=["fp32", "bf16"], default=None)
    ap.add_argument("--reverse", action="store_true", help="start with the last setting")
    ap.add_argument("--lm-head", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [n for n in SETTINGS if args.only is None or n.startswith(args.only)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names if (r % 2 == 0) != args.reverse else names[::-1]
        for name in order:
            t = time.perf_counter()
            res = run(name, args.steps, args.lm_head and name.endswith("fused"))
            runs[name].append(res)
            ms = " ".join(f"b{n}={v:.1f}" for n, v in res["ms_per_step"].items())
            print(f"round {r} {name:12s}: ms/step {ms}  W1 {res['w1_tok_s']:.0f} tok/s  RSS {res['rss_mb']:.0f} MB"
                  f"  fused={res['fused']} ({time.perf_counter() - t:.0f} s)", flush=True)
            if "lm_head_ms" in res:
                print("  LM head ms:", json.dumps(res["lm_head_ms"]), flush=True)
    summary = {n: {"ms_per_step": {b: statistics.median(x["ms_per_step"][b] for x in v) for b in v[0]["ms_per_step"]},
                   "w1_tok_s": statistics.median(x["w1_tok_s"] for x in v),
                   "rss_mb": statistics.median(x["rss_mb"] for x in v)} for n, v in runs.items()}
    for dt in ("fp32", "bf16"):
        a, b = runs.get(f"{dt} per-op"), runs.get(f"{dt} fused")
        if a and b:
            same = sum(x == y for x, y in zip(a[0]["texts"], b[0]["texts"], strict=True))
            summary[f"{dt} identical texts (batch 8, fused vs per-op)"] = f"{same}/8"
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": {k: [{kk: vv for kk, vv in x.items() if kk != "texts"} for x in v]
                                                     for k, v in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
