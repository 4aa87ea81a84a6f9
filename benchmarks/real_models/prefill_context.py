"""Prefill tok/s against context length: tokenloom vs llama.cpp's `llama-bench -p N -n 0`, alternating.

For each prompt length N, tokenloom's figure is N over the wall time of one fresh request with a
random N-token prompt and max_tokens=1 (add_request to finished: every prefill chunk the token
budget splits it into, then one sampled token; see single_stream.ttft_ms); llama.cpp's is
llama-bench's `pp` rate for `-p N` (`-t` threads, one repetition per round). The two run in turns,
`--rounds` times per length, so that a shared machine's load hits both alike; medians reported.

    .venv/bin/python benchmarks/real_models/prefill_context.py [MODEL.gguf] [--quantization gguf] \\
        --lengths 1024 4096 8192 [--max-num-batched-tokens 512] [--max-model-len 32768] \\
        --llama-bench ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-bench [--rounds 2] [--json out.json]

`--kv-cache-dtypes auto,float16` loads one engine per KV cache dtype and runs them in turns within each
round (the order alternating between rounds); each row then also gives every cache's tok/s and its median
per-round ratio to the first's.

Without --llama-bench only tokenloom runs. The engine's default context is capped at 8,192 tokens (a small
KV pool stays useful); a longer length raises it to that length + 1 unless --max-model-len says otherwise
(the 0.5B's full context: `--lengths 32767`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from single_stream import ttft_ms  # noqa: E402


def llama_bench_pp(binary: str, model: str, threads: int, prompt_len: int) -> float:
    """llama-bench's prompt-processing tok/s for a prompt_len prompt (one repetition)."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(prompt_len), "-n", "0", "-r", "1",
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = [r for r in json.loads(out) if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    return float(rows[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--quantization", default="default", choices=["default", "gguf", "int8", "none"],
                    help="default: the engine's default for the file (a quantized GGUF stays quantized); "
                         "none: dequantized to --dtype")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the token budget (default: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's context (default: the engine's, raised to the longest length + 1 if needed)")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="comma-separated --kv-cache-dtype values, run in turns (the first is the baseline)")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    kwargs: dict = {"dtype": a.dtype}  # max_model_len: the default (the model context, 8,192 at most)
    if a.quantization != "default":
        kwargs["quantization"] = a.quantization
    if a.max_model_len or max(a.lengths) >= 8192:
        kwargs["max_model_len"] = a.max_model_len or max(a.lengths) + 1
    if a.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = a.max_num_batched_tokens
    kv_dtypes = a.kv_cache_dtypes.split(",")
    engines = {kvd: LLMEngine.from_args(model=model, kv_cache_dtype=kvd, **kwargs) for kvd in kv_dtypes}
    budget = engines[kv_dtypes[0]].scheduler_config.max_num_batched_tokens
    for engine in engines.values():
        ttft_ms(engine, 64, seed=-1)  # warm-up: kernels, the first prefill's one-off work
    results = []
    for n in a.lengths:
        ours: dict[str, list[float]] = {kvd: [] for kvd in kv_dtypes}
        theirs: list[float] = []
        for r in range(a.rounds):
            for kvd in (kv_dtypes if r % 2 == 0 else kv_dtypes[::-1]):
                ours[kvd].append(n / ttft_ms(engines[kvd], n, seed=1000 * n + r) * 1e3)
            line = f"N={n} round {r}: tokenloom " + ", ".join(f"{ours[k][-1]:7.1f}" + (f" ({k} KV)" if len(
                kv_dtypes) > 1 else "") for k in kv_dtypes) + " tok/s"
            if a.llama_bench:
                theirs.append(llama_bench_pp(a.llama_bench, model, a.threads, n))
                line += f", llama-bench {theirs[-1]:7.1f} tok/s"
            print(line, flush=True)
        base = ours[kv_dtypes[0]]
        row = {"tokens": n, "tokenloom_tok_s": round(statistics.median(base), 1)}
        if len(kv_dtypes) > 1:
            row["tok_s_by_kv_cache_dtype"] = {k: round(statistics.median(v), 1) for k, v in ours.items()}
            row["ratio_to_first_kv_cache_dtype"] = {k: round(statistics.median(x / b for x, b in zip(v, base)), 3)
                                                    for k, v in ours.items() if k != kv_dtypes[0]}
        if theirs:
            row["llamacpp_tok_s"] = round(statistics.median(theirs), 1)
            row["ratio"] = round(row["tokenloom_tok_s"] / row["llamacpp_tok_s"], 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    out = {"model": Path(model).name, "quantization": a.quantization, "max_num_batched_tokens": budget,
           "kv_cache_dtypes": kv_dtypes, "results": results}
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
