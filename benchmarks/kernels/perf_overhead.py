"""Engine step overhead outside the model: what a step costs beyond the network's forward + logits.

Runs B requests (random token prompts, fixed output length, greedy, ignore_eos) through
`LLMEngine.step()` — the path `LLM.generate` takes, scheduler, runner, sampling, output processing
and incremental detokenization included — and times, per step, the whole step and the model's
own work (`DecoderModel.forward` + `compute_logits`). Overhead = step - model: scheduling, input
preparation, sampling, bookkeeping, outputs, detokenization. Decode-only steps are reported.

    .venv/bin/python benchmarks/kernels/perf_overhead.py [--batch 32,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def run(engine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    from tokenloom.sampling_params import RequestOutputKind, SamplingParams

    model = engine.runner.model
    model_time = [0.0]
    orig_forward, orig_logits = model.forward, model.compute_logits

    def forward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig_forward(*args, **kwargs)
        finally:
            model_time[0] += time.perf_counter() - t0

    def compute_logits(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig_logits(*args, **kwargs)
        finally:
            model_time[0] += time.perf_counter() - t0

    model.forward, model.compute_logits = forward, compute_logits
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    # FINAL_ONLY, as LLM.generate sets it (the server's engine process does no output processing at all).
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        prompt = [rng.randrange(17, vocab) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
    rows = []
    try:
        while engine.has_unfinished_requests():
            model_time[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            step = time.perf_counter() - t0
            core = engine.engine_core
            if core.last_step_tokens == batch:  # decode-only step with the whole batch running
                rows.append((step, model_time[0]))
    finally:
        model.forward, model.compute_logits = orig_forward, orig_logits
    steps = [r[0] for r in rows[1:]]  # the first decode step builds new GEMM primitives
    over = [r[0] - r[1] for r in rows[1:]]
    return {
        "batch": batch, "decode_steps": len(steps), "step_ms_median": round(1e3 * statistics.median(steps), 2),
        "model_ms_median": round(1e3 * statistics.median(r[1] for r in rows[1:]), 2),
        "overhead_ms_median": round(1e3 * statistics.median(over), 2),
        "overhead_share": round(statistics.median(o / s for o, s in zip(over, steps)), 4),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--batch", default="32,64,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["int8", "gguf"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(model=a.model, dtype=a.dtype, quantization=a.quantization)
    results = []
    for b in [int(x) for x in a.batch.split(",")]:
        res = run(engine, b, a.prompt_len, a.output_len, seed=b)
        results.append(res)
        print(f"batch {b:4d}: step {res['step_ms_median']:7.2f} ms, model {res['model_ms_median']:7.2f} ms, "
              f"outside the model {res['overhead_ms_median']:6.2f} ms = {100 * res['overhead_share']:.1f}%", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
