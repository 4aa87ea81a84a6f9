"""Prefill tok/s of `--quantization gguf`: the batched GEMM vs the small-batch tile kernel, A/B in one process.

Measures TTFT of fresh requests (random prompt ids, so no prefix-cache hit) of `--prompt-len`
tokens with max_tokens=1 (the prefill step, sampling, outputs: single_stream.py's `ttft_ms`), and
reports prompt_len / TTFT as prefill tok/s. The two settings alternate every round in the same
engine: B = the batched GEMM for >= TOKENLOOM_GGUF_GEMM_ROWS rows (the default), A = the tile kernel
at every size (TOKENLOOM_GGUF_GEMM_ROWS above the prompt). Medians over rounds, and the median of
the per-round ratios. Compare with `llama-bench -m FILE -t 2 -p 512 -n 0 -r 3` (its pp512 tok/s).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant/gguf_prefill.py FILE.gguf [--prompt-len 512] [--rounds 5] \
        [--only-gemm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.* and tokenloom
from benchmarks.real_models.single_stream import ttft_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only-gemm", action="store_true", help="skip the tile-kernel (A) runs")
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    engine = LLMEngine.from_args(model=model, quantization="gguf")
    default = os.environ.get("TOKENLOOM_GGUF_GEMM_ROWS")
    settings = {"gemm": default or "64"}
    if not a.only_gemm:
        settings = {"tiles": str(10 * a.prompt_len + 1), **settings}
    rates: dict[str, list[float]] = {k: [] for k in settings}
    seed = 0
    for rows in settings.values():  # warm-up of each path
        os.environ["TOKENLOOM_GGUF_GEMM_ROWS"] = rows
        ttft_ms(engine, a.prompt_len, seed=-1 - seed)
        seed += 1
    for r in range(a.rounds):
        order = list(settings.items()) if r % 2 == 0 else list(settings.items())[::-1]
        for name, rows in order:
            os.environ["TOKENLOOM_GGUF_GEMM_ROWS"] = rows
            ms = ttft_ms(engine, a.prompt_len, seed=seed)
            seed += 1
            rates[name].append(1e3 * a.prompt_len / ms)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:7.1f} tok/s" for k, v in rates.items()), flush=True)
    line = f"{Path(model).name} prefill {a.prompt_len} tokens, medians: " + ", ".join(
        f"{k} {statistics.median(v):.1f} tok/s" for k, v in rates.items())
    if "tiles" in rates:
        line += f", gemm / tiles {statistics.median(g / t for g, t in zip(rates['gemm'], rates['tiles'])):.2f}x"
    print(line)


if __name__ == "__main__":
    main()
