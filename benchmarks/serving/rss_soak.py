"""Memory soak: many short requests through the engine, resident set size sampled as they go.

Keeps --in-flight requests queued (random token prompts of 16..128 tokens, 4..32 output tokens,
ignore_eos), steps the engine until --requests have finished, and samples RSS every --every
finished requests. The KV cache is one allocation sized from the byte budget at start-up; the fused
CPU path leaves it uninitialised, so its pages are mapped as blocks are first written, which can
raise RSS until the pool has been cycled once (bounded by --kv-cache-memory). After that, RSS must
stay flat: the report gives the slope over the second half of the run.

    .venv/bin/python benchmarks/serving/rss_soak.py [--requests 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["int8"])
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the engine's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.sampling_params import SamplingParams

    rss0 = rss_mib()
    engine = LLMEngine.from_args(model=a.model, dtype=a.dtype, kv_cache_memory=a.kv_cache_memory,
                                 quantization=a.quantization)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    submitted = finished = steps = tokens = 0
    samples = [{"finished": 0, "rss_mib": rss_mib(), "t_s": 0.0, "steps": 0}]
    print(f"rss before the engine {rss0:.0f} MiB, after start-up {samples[0]['rss_mib']:.0f} MiB", flush=True)
    t0 = time.perf_counter()
    next_sample = a.every
    while finished < a.requests:
        while submitted < a.requests and submitted - finished < a.in_flight:
            prompt = [rng.randrange(17, vocab) for _ in range(rng.randint(16, 128))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 32), ignore_eos=True)
            engine.add_request(f"s{submitted}", {"prompt_token_ids": prompt}, params)
            submitted += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                tokens += len(out.outputs[0].token_ids)
        steps += 1
        if finished >= next_sample:
            samples.append({"finished": finished, "rss_mib": round(rss_mib(), 1),
                            "t_s": round(time.perf_counter() - t0, 1), "steps": steps})  # fmt: skip
            print(f"{finished:6d} finished, {steps:6d} steps, {samples[-1]['t_s']:7.1f} s, "
                  f"RSS {samples[-1]['rss_mib']:7.1f} MiB", flush=True)
            next_sample += a.every
    half = [s for s in samples if s["finished"] >= a.requests // 2]
    slope = (half[-1]["rss_mib"] - half[0]["rss_mib"]) / max(1, half[-1]["finished"] - half[0]["finished"]) * 1000
    summary = {
        "requests": a.requests, "output_tokens": tokens, "steps": steps, "wall_s": round(time.perf_counter() - t0, 1),
        "rss_start_mib": samples[0]["rss_mib"], "rss_max_mib": max(s["rss_mib"] for s in samples),
        "rss_end_mib": samples[-1]["rss_mib"], "second_half_slope_mib_per_1000_requests": round(slope, 2),
        "kv_cache_mib": round(sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches) / 2**20, 1),
    }  # fmt: skip
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
