"""Decode gaps while a long prompt prefills: does the token budget still bound them at long contexts?

`--decodes` requests decode (short random prompts, ignore_eos); once each has its first token, one
long prompt (`--prompt-len` random tokens) arrives, and the engine steps until that prompt has its first
token. Reported per token budget: the decoding requests' gaps between tokens while the long prompt
prefilled (p50 / p99 / max), the long prompt's time to first token, and the steps it took. A chunk late in
a long prompt attends over everything before it, so it costs more per token than an early one: the
automatic budget (the default) learns the rate from the steps it runs (core/auto_budget.py); a fixed
budget (`2048`: vLLM's) does not look at time at all. The budgets' engines are all built first and run
in turns, `--rounds` times.

    .venv/bin/python benchmarks/real_models/long_prompt_gaps.py QWEN05.gguf --prompt-len 16384 \\
        --budgets auto 2048 [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(engine, prompt_len: int, decodes: int, seed: int) -> dict:  # noqa: ANN001 - an LLMEngine
    from tokenloom.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    decode_params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True,
                                   output_kind=RequestOutputKind.CUMULATIVE)
    short_ids = [f"d{seed}-{i}" for i in range(decodes)]
    for rid in short_ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(17, vocab) for _ in range(64)]}, decode_params)
    last_token_at: dict[str, float] = {}
    while len(last_token_at) < decodes:  # every decode has its first token
        for out in engine.step():
            last_token_at[out.request_id] = time.perf_counter()
    long_id = f"long{seed}"
    long_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                 output_kind=RequestOutputKind.FINAL_ONLY)
    arrived = time.perf_counter()
    engine.add_request(long_id, {"prompt_token_ids": [rng.randrange(17, vocab) for _ in range(prompt_len)]},
                       long_params)
    gaps: list[float] = []
    steps = 0
    done = False
    while not done:
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == long_id:
                done = True
            elif out.outputs and out.outputs[0].delta_token_ids:
                gaps.append(now - max(last_token_at[out.request_id], arrived))
                last_token_at[out.request_id] = now
    ttft = time.perf_counter() - arrived
    engine.abort_request(short_ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {"ttft_s": round(ttft, 2), "steps": steps, "gaps": len(gaps),
            "gap_p50_s": round(percentile(gaps, 0.5), 3), "gap_p99_s": round(percentile(gaps, 0.99), 3),
            "gap_max_s": round(max(gaps), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=16384)
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--budgets", nargs="+", default=["auto", "2048"],
                    help="'auto' (the default: unset) or a fixed --max-num-batched-tokens")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tokenloom.engine.llm_engine import LLMEngine

    kwargs: dict = {}  # the defaults (random prompts: no prefix-cache hits)
    if a.prompt_len + 1 > 8192:  # past the engine's default context cap
        kwargs["max_model_len"] = a.prompt_len + 1
    engines = {}
    for budget in a.budgets:
        extra = {} if budget == "auto" else {"max_num_batched_tokens": int(budget)}
        engines[budget] = LLMEngine.from_args(model=a.model, **kwargs, **extra)
        one_round(engines[budget], 256, a.decodes, seed=-1)  # warm-up: kernels, the rate's first samples
    results: dict[str, list[dict]] = {b: [] for b in a.budgets}
    for r in range(a.rounds):
        for budget, engine in engines.items():
            row = one_round(engine, a.prompt_len, a.decodes, seed=1000 * r + 7)
            results[budget].append(row)
            print(f"round {r}, budget {budget}: {json.dumps(row)}", flush=True)
    summary = {b: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for b, rows in results.items()}
    out = {"model": Path(a.model).name, "prompt_len": a.prompt_len, "decodes": a.decodes, "rounds": results,
           "median": summary}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
