"""Single-stream decode and TTFT: tokenloom vs llama.cpp's `llama-bench` on the same GGUF, alternating.

One request at a time, greedy, ignore_eos: tokenloom's decode tok/s is 1000 / the median decode
step (the engine's whole step: schedule, inputs, forward, logits, sampling, outputs; see
perf_overhead.py), llama.cpp's is llama-bench's `tg` figure (`-n N`, `-t` threads). TTFT: tokenloom's
is the wall time of a fresh request with a `--ttft-prompt-len` random prompt and max_tokens=1
(add_request to finished: the prefill step, sampling, outputs); llama.cpp's is that prompt length
over llama-bench's `pp` rate for it (`-p P`). The two run in turns, `--rounds` times, so that a
shared machine's load hits both alike; medians reported.

    .venv/bin/python benchmarks/real_models/single_stream.py [MODEL.gguf] \\
        --llama-bench ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-bench [--rounds 3] [--json out.json]

Without --llama-bench only tokenloom runs. `--quantization` defaults to the engine's own default (a
quantized GGUF stays quantized); `--quantization none` is the dequantized float path. The result also
has the weights' bytes in memory and the process RSS after the engine is built (before any request).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.* and tokenloom
from benchmarks.kernels.perf_overhead import run  # noqa: E402


def llama_bench(binary: str, model: str, threads: int, n: int, prompt_len: int,
                extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """(tg tok/s, TTFT ms for a prompt_len prompt) from one llama-bench run (`extra`: more llama-bench args)."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(prompt_len), "-n", str(n), "-r", "1",
                          "-o", "json", *extra], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    tg = [r for r in rows if r.get("n_gen", 0) > 0][0]
    pp = [r for r in rows if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0][0]
    return float(tg["avg_ts"]), 1e3 * prompt_len / float(pp["avg_ts"])


def ttft_ms(engine, prompt_len: int, seed: int) -> float:  # noqa: ANN001 - an LLMEngine
    """Wall time of one fresh request (random prompt, so no prefix-cache hit) with max_tokens=1."""
    from tokenloom.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(10_000 + seed)
    prompt = [rng.randrange(17, engine.model_config.vocab_size) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    t0 = time.perf_counter()
    engine.add_request(f"ttft-{seed}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * (time.perf_counter() - t0)


def rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--quantization", default="default", choices=["default", "gguf", "int8", "none"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="extra llama-bench argument, repeatable (e.g. --llama-arg=--repack --llama-arg=0 on an AMX "
                         "Xeon, where the shared build's repacked / AMX kernels die with SIGILL)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ttft-prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    quant = None if a.quantization == "default" else a.quantization
    engine = LLMEngine.from_args(model=model, dtype=a.dtype, quantization=quant)
    weights_mib = engine.runner.model.weight_bytes() / 2**20
    rss_mib = rss_now_mib()
    ttft_ms(engine, a.ttft_prompt_len, seed=-1)  # warm-up: first prefill builds the dequantized-GEMM path
    ours, theirs, our_ttft, their_ttft = [], [], [], []
    for r in range(a.rounds):
        res = run(engine, 1, a.prompt_len, a.output_len, seed=r)
        ours.append(1000.0 / res["step_ms_median"])
        our_ttft.append(ttft_ms(engine, a.ttft_prompt_len, seed=r))
        line = (f"round {r}: tokenloom {ours[-1]:7.1f} tok/s, TTFT {our_ttft[-1]:6.1f} ms "
                f"(host work outside the model {res['overhead_ms_median']} ms)")
        if a.llama_bench:
            tg, ttft = llama_bench(a.llama_bench, model, a.threads, a.output_len, a.ttft_prompt_len,
                                   tuple(a.llama_arg))
            theirs.append(tg)
            their_ttft.append(ttft)
            line += f"; llama.cpp {tg:7.1f} tok/s, TTFT {ttft:6.1f} ms"
        print(line, flush=True)
    result = {"model": Path(model).name, "quantization": engine.config.quantization or "none",
              "dtype": str(engine.dtype).replace("torch.", ""), "tokenloom_tok_s": statistics.median(ours),
              "tokenloom_ttft_ms": statistics.median(our_ttft), "ttft_prompt_len": a.ttft_prompt_len,
              "tokenloom_prefill_tok_s": 1e3 * a.ttft_prompt_len / statistics.median(our_ttft),
              "weights_mib": round(weights_mib, 1), "rss_after_start_mib": round(rss_mib, 1),
              "file_mib": round(Path(model).stat().st_size / 2**20, 1)}
    if theirs:
        result["llamacpp_tok_s"] = statistics.median(theirs)
        result["llamacpp_ttft_ms"] = statistics.median(their_ttft)
        result["ratio"] = result["tokenloom_tok_s"] / result["llamacpp_tok_s"]
        result["llamacpp_prefill_tok_s"] = 1e3 * a.ttft_prompt_len / result["llamacpp_ttft_ms"]
        result["prefill_ratio"] = result["tokenloom_prefill_tok_s"] / result["llamacpp_prefill_tok_s"]
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
