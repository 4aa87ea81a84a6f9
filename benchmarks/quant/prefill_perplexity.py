"""Perplexity through the prefill path: one forward over each text (prompt_logprobs), per method.

quant_quality.py feeds texts one token per step (the decode kernels); this one scores each text as
a single prompt, so with `--quantization gguf` every linear runs the batched prefill GEMM
(gguf_gemm_packed, >= TOKENLOOM_GGUF_GEMM_ROWS rows). Methods: `none` (the same file dequantized
to float32), `gguf` (the batched GEMM), `gguf-tiles` (the small-batch tile kernel at every size).
Texts: --tokens-long windows of the GPL-3 and Artistic licences and textwrap.py (quant_quality.py's).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant/prefill_perplexity.py --model FILE.gguf [--tokens 512]
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Artistic", textwrap.__file__]

CHILD = r"""
import math, sys
from tokenloom import LLM, SamplingParams
model, method, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=model, quantization=None if method == "none" else "gguf", enable_prefix_caching=False)
tok = llm.get_tokenizer()
for path in sys.argv[4:]:
    ids = tok.encode(open(path).read())[:n]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = 0.0
    for t, lp in zip(ids[1:], out.prompt_logprobs[1:]):
        nll -= lp[t].logprob
    print(f"PPL {path} {math.exp(nll / (len(ids) - 1)):.4f}", flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--methods", default="none,gguf,gguf-tiles")
    a = ap.parse_args()
    texts = [t for t in TEXTS if Path(t).is_file()]
    res: dict[str, list[float]] = {}
    for method in a.methods.split(","):
        env = dict(os.environ)
        if method == "gguf-tiles":
            env["TOKENLOOM_GGUF_GEMM_ROWS"] = str(1 << 30)
        out = subprocess.run([sys.executable, "-c", CHILD, a.model, method.split("-")[0], str(a.tokens), *texts],
                             env=env, capture_output=True, text=True, check=True).stdout
        res[method] = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("PPL ")]
        print(method, " ".join(f"{p:.4f}" for p in res[method]),
              f"geomean {math.exp(sum(map(math.log, res[method])) / len(res[method])):.4f}", flush=True)
    if "none" in res:
        base = res["none"]
        for m, v in res.items():
            if m != "none":
                ch = [100 * (x / b - 1) for x, b in zip(v, base)]
                print(f"{m} vs none: " + " ".join(f"{c:+.2f} %" for c in ch))


if __name__ == "__main__":
    main()
