"""Speculative decoding, side by side in one process: plain decoding vs n-gram (and suffix) drafts.

    # single-stream TPOT on the input-grounded workload (texts the output copies), alternating;
    # --clock cpu times with the process's CPU time (one thread), for a machine shared with others
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode/spec_decode_bench.py tpot --prompts 6 \
        --max-tokens 128 --clock cpu
    # off vs n-gram vs suffix decoding (needs arctic-inference), the prompt set run twice
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec_decode/spec_decode_bench.py tpot \
        --methods off,ngram,suffix --passes 2 \
        --prompts 6 --max-tokens 128 --clock cpu
    # W1-style random prompts (nothing to copy), all at t=0: off vs vLLM's policy vs adaptive
    .venv/bin/python benchmarks/spec_decode/spec_decode_bench.py random --num-prompts 32 --input-len 256 --output-len 64

`tpot` runs each prompt on the plain engine and on the speculative ones, rotating which goes first
from prompt to prompt (the machine is shared: alternating spreads any load over both), and reports
the median time per output token after the first, the speedup, acceptance, and whether the greedy
outputs are token-identical. `random` runs the batch on each engine in turn, rounds alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenloom import LLM, SamplingParams
from tokenloom.config import engine_config_from_kwargs
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.workload.datasets import random_requests
from tokenloom.workload.grounded import grounded_messages


def _spec(k: int, lookup_max: int, lookup_min: int, adaptive: bool = False) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup_max,
            "prompt_lookup_min": lookup_min, "adaptive": adaptive}


def _llm(clock: str, **kwargs) -> LLM:
    """An LLM whose request timestamps come from `clock`: "wall", or "cpu" (this process's CPU time:
    with OMP_NUM_THREADS=1, the work done, whatever else runs on a shared machine)."""
    if clock == "wall":
        return LLM(**kwargs)
    llm = LLM.__new__(LLM)
    llm.llm_engine = LLMEngine(engine_config_from_kwargs(**kwargs), clock=time.process_time)
    return llm


def _tpot(out) -> float:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    return (m.last_token_time - m.first_token_time) / max(n - 1, 1)


def _method_configs(args: argparse.Namespace) -> dict[str, dict | None]:
    """--methods: off, ngram (the --k/--lookup-* knobs), suffix (--suffix-config)."""
    table = {"off": None, "ngram": _spec(args.k, args.lookup_max, args.lookup_min),
             "suffix": json.loads(args.suffix_config)}
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in table]
    if unknown or "off" not in names or len(names) < 2:
        raise SystemExit(f"--methods: a comma list of off, ngram, suffix, with off and one more; got {args.methods!r}")
    return {m: table[m] for m in names}


def run_tpot(args: argparse.Namespace) -> dict:
    knobs = {"kv_cache_memory": 512 << 20, "quantization": args.quantization}
    engines = {name: _llm(args.clock, **knobs, speculative_config=cfg) for name, cfg in _method_configs(args).items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = [[{"role": "user", "content": "Say hello."}]]
    for llm in engines.values():
        llm.chat(warm, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    spec_names = [n for n in engines if n != "off"]
    passes = []
    identical = {n: True for n in spec_names}
    n_tokens = 0
    convs = grounded_messages(args.prompts)
    for pass_no in range(args.passes):
        # Each pass runs every prompt again: the suffix proposer's global tree then holds the earlier
        # pass's outputs (cross-request learning); the n-gram proposer sees each request alone.
        tpots: dict[str, list[float]] = {k: [] for k in engines}
        before = {n: engines[n].llm_engine.scheduler.spec_decoding_totals.to_dict() for n in spec_names}
        for i, conv in enumerate(convs):
            names = list(engines)
            shift = i % len(names)  # rotate which engine goes first, prompt by prompt
            order = names[shift:] + names[:shift]
            toks = {}
            for name in order:
                out = engines[name].chat([conv], params, use_tqdm=False)[0]
                tpots[name].append(_tpot(out))
                toks[name] = out.outputs[0].token_ids
            for n in spec_names:
                identical[n] &= toks[n] == toks["off"]
            n_tokens += len(toks["off"])
            print(f"pass {pass_no} prompt {i}: {len(toks['off'])} tokens, TPOT "
                  + ", ".join(f"{n} {tpots[n][-1] * 1e3:.1f} ms" for n in engines), flush=True)
        med = {k: statistics.median(v) * 1e3 for k, v in tpots.items()}
        row = {"tpot_ms_median": med, "speedup": {n: med["off"] / med[n] for n in spec_names}, "acceptance": {}}
        for n in spec_names:
            after = engines[n].llm_engine.scheduler.spec_decoding_totals.to_dict()
            drafted = after["num_draft_tokens"] - before[n]["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before[n]["num_accepted_tokens"]
            drafts = after["num_drafts"] - before[n]["num_drafts"]
            row["acceptance"][n] = {"draft_tokens": drafted, "accepted_tokens": accepted, "verifications": drafts,
                                    "acceptance_rate": accepted / drafted if drafted else 0.0,
                                    "accepted_per_verification": accepted / drafts if drafts else 0.0}
        passes.append(row)
    result = {"workload": "grounded", "clock": args.clock, "prompts": args.prompts, "passes": args.passes,
              "output_tokens": n_tokens, "configs": {n: _method_configs(args)[n] for n in spec_names},
              "identical_greedy_outputs": identical, "per_pass": passes}
    for n in spec_names:
        stats = engines[n].llm_engine.scheduler.spec_decoding_totals
        result.setdefault("spec", {})[n] = stats.to_dict()
    return result


def run_random(args: argparse.Namespace) -> dict:
    knobs = {"kv_cache_memory": 1 << 30, "quantization": args.quantization}
    configs = {"off": None, "ngram": _spec(args.k, args.lookup_max, args.lookup_min),
               "ngram-adaptive": _spec(args.k, args.lookup_max, args.lookup_min, adaptive=True)}
    engines = {name: _llm(args.clock, **knobs, speculative_config=c) for name, c in configs.items()}
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, seed=args.seed)
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    walls: dict[str, list[float]] = {k: [] for k in engines}
    for rnd in range(args.rounds):
        order = list(engines) if rnd % 2 == 0 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            llm.llm_engine.reset_scheduler()  # empty prefix cache each run
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            t0 = clock()
            llm.generate(prompts, params, use_tqdm=False)
            walls[name].append(clock() - t0)
            print(f"round {rnd} {name}: {walls[name][-1]:.1f} s", flush=True)
    n_out = sum(r.max_tokens for r in reqs)
    result = {"workload": "random", "clock": args.clock, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "output_tokens": n_out, "wall_s_median": {}, "vs_off": {}}
    for name, w in walls.items():
        result["wall_s_median"][name] = statistics.median(w)
        stats = engines[name].llm_engine.scheduler.spec_decoding_totals
        if stats is not None:
            result.setdefault("spec", {})[name] = stats.to_dict()
    for name in engines:
        result["vs_off"][name] = result["wall_s_median"][name] / result["wall_s_median"]["off"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["tpot", "random"])
    p.add_argument("--methods", default="off,ngram",
                   help="tpot: the engines compared, a comma list of off, ngram, suffix (off required)")
    p.add_argument("--suffix-config", default='{"method": "suffix"}',
                   help="tpot: the suffix engine's --speculative-config (vLLM's defaults: K = tree depth 24)")
    p.add_argument("--passes", type=int, default=1,
                   help="tpot: run the prompt set this many times (pass 2+: the suffix tree knows the outputs)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--quantization", default=None)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: time with this process's CPU time (use OMP_NUM_THREADS=1) on a shared machine")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    result = run_tpot(args) if args.part == "tpot" else run_random(args)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
