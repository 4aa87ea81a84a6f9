"""Single-stream decode: tokenloom vs llama.cpp's `llama-bench` on the same GGUF, alternating.

One request at a time, greedy, ignore_eos: tokenloom's decode tok/s is 1000 / the median decode
step (the engine's whole step: schedule, inputs, forward, logits, sampling, outputs; see
perf_overhead.py), llama.cpp's is llama-bench's `tg` figure (`-p 0 -n N`, `-t` threads). The two
run in turns, `--rounds` times, so that a shared machine's load hits both alike; medians reported.

    .venv/bin/python benchmarks/single_stream.py [MODEL.gguf] --quantization gguf \\
        --llama-bench ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-bench [--rounds 3] [--json out.json]

Without --llama-bench only tokenloom runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from perf_overhead import run  # noqa: E402


def llama_bench(binary: str, model: str, threads: int, n: int) -> float:
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(n), "-r", "1", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rows = [r for r in json.loads(out) if r.get("n_gen", 0) > 0]
    return float(rows[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--quantization", default="gguf", choices=["gguf", "int8", "none"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    quant = None if a.quantization == "none" else a.quantization
    engine = LLMEngine.from_args(model=model, dtype=a.dtype, quantization=quant)
    ours, theirs = [], []
    for r in range(a.rounds):
        res = run(engine, 1, a.prompt_len, a.output_len, seed=r)
        ours.append(1000.0 / res["step_ms_median"])
        line = (f"round {r}: tokenloom {ours[-1]:7.1f} tok/s "
                f"(host work outside the model {res['overhead_ms_median']} ms)")
        if a.llama_bench:
            theirs.append(llama_bench(a.llama_bench, model, a.threads, a.output_len))
            line += f", llama.cpp {theirs[-1]:7.1f} tok/s"
        print(line, flush=True)
    result = {"model": Path(model).name, "quantization": a.quantization, "tokenloom_tok_s": statistics.median(ours)}
    if theirs:
        result["llamacpp_tok_s"] = statistics.median(theirs)
        result["ratio"] = result["tokenloom_tok_s"] / result["llamacpp_tok_s"]
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
