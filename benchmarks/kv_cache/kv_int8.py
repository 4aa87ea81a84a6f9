"""--kv-cache-dtype int8 (and the 16-bit caches, bfloat16 / float16) against the run dtype's KV on the
default model (SmolLM2-135M GGUF) or --model: capacity, decode speed at a long context, perplexity
(docs/kv_cache.md).

* `capacity`: the pool's blocks at --kv-cache-memory (the engine's own sizing) and the sequences of
  --context tokens it holds at once; then measured: --num-requests distinct 256-token prompts into an
  engine whose pool is --small-memory, stepping it and recording the most requests running at once.
* `decode`: decode tok/s of --batch sequences at --context tokens each (distinct contexts, prefilled
  once and then served from the prefix cache, so each round is the decode), rounds alternating float /
  int8 engines that live side by side in this process.
* `ppl`: perplexity of --ppl-tokens-token windows of three texts through prompt_logprobs (one forward
  per text; the prompt's own K/V is written to the cache and read back, so int8 KV is in the path).
* `kernel`: the fused paged-attention kernel alone (SmolLM2's heads: 9 q, 3 kv, 64 wide; one layer),
  --batch decodes of --context keys each, per cache: bf16 packed (where the CPU has it), bf16 plain,
  int8 with bf16 queries, float32, int8, fp16 and bf16 with float32 queries; the caches alternate round
  by round.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_cache/kv_int8.py [--what capacity,decode,ppl]
        [--dtypes bfloat16,float32] [--kv-dtypes auto,int8] [--model FILE] [--context 4096] [--batch 1,4]
        [--rounds 3] [--out result.json]

Each --kv-dtypes entry is compared with the first (auto: the run dtype's cache).

Timings on a shared machine: run under `flock /tmp/tokenloom-bench.lock` and read them as A/B ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom import LLM, SamplingParams  # noqa: E402

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Artistic", textwrap.__file__]
KV_DTYPES = ["auto", "int8"]  # --kv-dtypes; the first is the baseline the others are compared with
MODEL: str | None = None  # --model (None: the default model)


def _corpus_ids(llm: LLM) -> list[int]:
    tok = llm.get_tokenizer()
    ids: list[int] = []
    for path in TEXTS:
        if Path(path).is_file():
            ids += tok.encode(Path(path).read_text())
    return ids


def capacity(dtype: str, memory: int, context: int, small_memory: int, num_requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kvd in KV_DTYPES:
        llm = LLM(MODEL, dtype=dtype, kv_cache_dtype=kvd, kv_cache_memory=memory, max_model_len=context + 64)
        blocks = llm.llm_engine.cache_config.num_blocks
        bs = llm.llm_engine.cache_config.block_size
        llm.llm_engine.close()
        per_seq = -(-(context + 1) // bs)  # a sequence of `context` tokens that generates one more
        # Measured: how many of `num_requests` 256-token prompts (+ 32 generated) run at once.
        llm = LLM(MODEL, dtype=dtype, kv_cache_dtype=kvd, kv_cache_memory=small_memory, enable_prefix_caching=False,
                  max_model_len=512)
        engine = llm.llm_engine
        corpus = _corpus_ids(llm)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        for i in range(num_requests):
            engine.add_request(f"r{i}", {"prompt_token_ids": corpus[i * 256 : (i + 1) * 256]}, params)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, len(engine.scheduler.running))
        small_blocks = engine.cache_config.num_blocks
        engine.close()
        out[kvd] = {"num_blocks": blocks, "block_size": bs, "sequences_at_context": blocks // per_seq,
                    "small_pool_blocks": small_blocks, "measured_peak_running": peak}
        print(f"capacity {dtype} {kvd}: {blocks} blocks in {memory / 2**20:.0f} MiB -> {blocks // per_seq} "
              f"sequences of {context} tokens; {small_memory / 2**20:.0f} MiB pool ({small_blocks} blocks): "
              f"{peak} of {num_requests} 256-token requests running at once", flush=True)
    return out


def decode(dtype: str, context: int, batches: list[int], rounds: int, max_tokens: int) -> dict[str, Any]:
    engines = {kvd: LLM(MODEL, dtype=dtype, kv_cache_dtype=kvd, kv_cache_memory=1 << 30,
                        max_model_len=context + 256) for kvd in KV_DTYPES}
    corpus = _corpus_ids(engines[KV_DTYPES[0]])
    while len(corpus) < max(batches) * context + max(batches):
        corpus += corpus
    contexts = [corpus[i * 97 : i * 97 + context] for i in range(max(batches))]  # distinct, overlapping text
    prefill = SamplingParams(temperature=0.0, max_tokens=1)
    for kvd, llm in engines.items():  # prefill every context once: later rounds hit the prefix cache
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": c} for c in contexts], prefill, use_tqdm=False)
        print(f"decode {dtype} {kvd}: prefilled {len(contexts)} x {context} tokens in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res: dict[str, Any] = {str(b): {kvd: [] for kvd in KV_DTYPES} for b in batches}
    for r in range(rounds):
        for b in batches:
            order = KV_DTYPES if r % 2 == 0 else KV_DTYPES[::-1]  # alternate which run first
            for kvd in order:
                outs = engines[kvd].generate([{"prompt_token_ids": c} for c in contexts[:b]], params,
                                             use_tqdm=False)
                first = max(o.metrics.first_token_time for o in outs)
                last = max(o.metrics.last_token_time for o in outs)
                tps = b * (max_tokens - 1) / (last - first)
                res[str(b)][kvd].append(tps)
                print(f"decode {dtype} round {r} batch {b} {kvd}: {tps:.1f} tok/s", flush=True)
    for llm in engines.values():
        llm.llm_engine.close()
    base = KV_DTYPES[0]
    for b in batches:
        f = res[str(b)][base]
        for kvd in KV_DTYPES[1:]:
            q = res[str(b)][kvd]
            ratios = [y / x for x, y in zip(f, q)]
            print(f"decode {dtype} batch {b} at {context}: {base} {min(f):.1f}-{max(f):.1f}, {kvd} {min(q):.1f}-"
                  f"{max(q):.1f} tok/s; {kvd}/{base} per round {', '.join(f'{x:.2f}' for x in ratios)}", flush=True)
    return res


def perplexity(dtype: str, tokens: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for kvd in KV_DTYPES:
        llm = LLM(MODEL, dtype=dtype, kv_cache_dtype=kvd, enable_prefix_caching=False, kv_cache_memory=256 << 20)
        tok = llm.get_tokenizer()
        ppl = []
        for path in TEXTS:
            if not Path(path).is_file():
                continue
            ids = tok.encode(Path(path).read_text())[:tokens]
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            nll = -sum(lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:]))
            ppl.append(math.exp(nll / (len(ids) - 1)))
        llm.llm_engine.close()
        res[kvd] = ppl
        print(f"ppl {dtype} {kvd}: " + " ".join(f"{p:.4f}" for p in ppl), flush=True)
    base = KV_DTYPES[0]
    for kvd in KV_DTYPES[1:]:
        change = [100 * (q / f - 1) for f, q in zip(res[base], res[kvd])]
        geo = 100 * (math.exp(sum(math.log(q / f) for f, q in zip(res[base], res[kvd])) / len(change)) - 1)
        # The int8 entry keeps its old key (the figures already recorded read it).
        res["change_percent" if kvd == "int8" else f"change_percent_{kvd}"] = change
        print(f"ppl {dtype} {kvd} vs {base} KV: " + " ".join(f"{c:+.2f} %" for c in change)
              + f" (geomean {geo:+.2f} %)", flush=True)
    return res


def kernel(context: int, batches: list[int], rounds: int) -> dict[str, Any]:
    import torch

    from tokenloom.model.attention import KernelMetadata, pack_kv_layout, paged_attention_fused, quantize_kv
    from tokenloom.model.kernels import cpu_kernels

    k_mod = cpu_kernels()
    if k_mod is None:
        raise SystemExit("the compiled CPU kernels are unavailable")
    hq, hkv, d, bs = 9, 3, 64, 16
    res: dict[str, Any] = {}
    for b in batches:
        per = -(-(context + 1) // bs)
        g = torch.Generator().manual_seed(0)
        kf = torch.randn(hkv, b * per, bs, d, generator=g)
        vf = torch.randn(hkv, b * per, bs, d, generator=g)
        kq, ks = quantize_kv(kf)
        vq, vs = quantize_kv(vf)
        meta = KernelMetadata(block_tables=torch.arange(b * per, dtype=torch.int32).view(b, per),
                              q_start=torch.arange(b + 1, dtype=torch.int32),
                              pos_start=torch.full((b,), context, dtype=torch.int32))
        qkv = {dt: torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dt) for dt in (torch.bfloat16, torch.float32)}
        caches: dict[str, tuple[Any, Any, bool]] = {
            "bf16 plain": ((kf.bfloat16(), vf.bfloat16()), qkv[torch.bfloat16], False),
            "int8 (bf16 q)": ((kq, vq, ks, vs), qkv[torch.bfloat16], False),
            "float32": ((kf, vf), qkv[torch.float32], False),
            "int8 (fp32 q)": ((kq, vq, ks, vs), qkv[torch.float32], False),
            "fp16 (fp32 q)": ((kf.half(), vf.half()), qkv[torch.float32], False),
            "bf16 (fp32 q)": ((kf.bfloat16(), vf.bfloat16()), qkv[torch.float32], False),
        }
        if k_mod.packed_layout_supported(bs, d):
            caches["bf16 packed"] = (pack_kv_layout(kf.bfloat16(), vf.bfloat16()), qkv[torch.bfloat16], True)
        times: dict[str, list[float]] = {name: [] for name in caches}
        for r in range(rounds):
            names = list(caches) if r % 2 == 0 else list(caches)[::-1]
            for name in names:
                cache, q, packed = caches[name]
                paged_attention_fused(k_mod, q, hq, cache, meta, packed)  # warm
                t0 = time.perf_counter()
                for _ in range(5):
                    paged_attention_fused(k_mod, q, hq, cache, meta, packed)
                times[name].append((time.perf_counter() - t0) / 5 * 1e3)
        res[str(b)] = times
        for name, ts in times.items():
            print(f"kernel batch {b} x {context} keys, {name}: {min(ts):.2f}-{max(ts):.2f} ms a layer", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="capacity,decode,ppl")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--kv-dtypes", default="auto,int8", help="--kv-cache-dtype values; the first is the baseline")
    ap.add_argument("--model", help="a model path or GGUF file (default: the default model)")
    ap.add_argument("--memory", type=lambda s: int(float(s) * 2**20), default=2048 << 20,
                    help="MiB of KV pool for the capacity count (default 2048, the engine's default)")
    ap.add_argument("--small-memory", type=lambda s: int(float(s) * 2**20), default=16 << 20,
                    help="MiB of the pool the measured concurrency runs in (default 16)")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=33)
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    global MODEL
    KV_DTYPES[:] = a.kv_dtypes.split(",")
    MODEL = a.model
    what = set(a.what.split(","))
    result: dict[str, Any] = {"context": a.context, "kv_dtypes": KV_DTYPES, "model": a.model}
    if "kernel" in what:
        result["kernel"] = kernel(a.context, [int(b) for b in a.batch.split(",")], a.rounds)
    for dtype in a.dtypes.split(","):
        r: dict[str, Any] = {}
        if "capacity" in what:
            r["capacity"] = capacity(dtype, a.memory, a.context, a.small_memory, a.num_requests)
        if "ppl" in what:
            r["ppl"] = perplexity(dtype, a.ppl_tokens)
        if "decode" in what:
            r["decode"] = decode(dtype, a.context, [int(b) for b in a.batch.split(",")], a.rounds, a.max_tokens)
        result[dtype] = r
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
