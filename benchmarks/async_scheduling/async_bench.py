"""Sync vs async scheduling, alternating, short runs (docs/async.md).

Each round runs both modes back to back (the order flips every round), each in a fresh process
with its engine built for that mode, as a user gets it (`LLM(async_scheduling=...)`): an engine
built for async loads and steps its model on one thread (engine/executor.py, ModelThread), which
switching a sync-built engine with `reset_scheduler` would not reproduce.

  single stream   one request, 32-token prompt, --tokens outputs (ignore_eos): TPOT from the
                  engine's first/last token times
  W1-style        --requests requests at t=0, prompts 64-512 tokens (seeded), --w1-tokens outputs
                  each: output tokens/s over the wall time of LLM.generate
  hidden host     from the step trace: each step's host work (schedule + update) and the share of
                  it that ran while the worker thread executed a step (async hides that share)

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_scheduling/async_bench.py --rounds 3 --json /tmp/async.json
    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_scheduling/async_bench.py --dtype bfloat16 --quantization int8
    # sync + n-gram drafts vs async + n-gram drafts, single stream only (docs/speculative.md)
    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_scheduling/async_bench.py --no-w1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

With --speculative-config the single-stream prompt repeats a 16-token pattern (so the n-gram
proposer has something to copy) and each mode also reports its acceptance figures.

The machine is shared (2 cores, other processes running): compare the modes within a round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams


def _overlap(a0: float, a1: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for b0, b1 in spans)


def host_figures(records: list[dict]) -> dict:
    """Per step: host seconds (schedule + update) and the part that overlapped any step's execution."""
    spans = [(r["t_exec_start"], r["t_exec_end"]) for r in records if r.get("t_exec_start") is not None]
    host = hidden = execute = 0.0
    for r in records:
        parts = [(r["t_start"], r["t_scheduled"]), (r["t_update"], r["t_end"])]
        for a0, a1 in parts:
            host += a1 - a0
            hidden += _overlap(a0, a1, spans)
        if r.get("t_exec_start") is not None:
            execute += r["t_exec_end"] - r["t_exec_start"]
    n = max(len(records), 1)
    wall = (records[-1]["t_end"] - records[0]["t_start"]) if records else 0.0
    return {"steps": len(records), "host_ms_per_step": 1e3 * host / n, "hidden_ms_per_step": 1e3 * hidden / n,
            "hidden_share": hidden / host if host else 0.0, "execute_ms_per_step": 1e3 * execute / n,
            "wall_ms_per_step": 1e3 * wall / n}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    """One mode (args.one) in this process: the single stream, then the W1-style batch."""
    mode = args.one
    trace = Path(tempfile.mkdtemp()) / "steps.jsonl"
    llm = LLM(dtype=args.dtype, quantization=args.quantization, trace_steps=str(trace),
              speculative_config=args.speculative_config, async_scheduling=mode == "async")
    engine = llm.llm_engine
    rng = random.Random(20251130)
    w1 = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(rng.randrange(64, 513))]}
          for _ in range(args.requests)]  # fmt: skip
    single = [{"prompt_token_ids": list(range(200, 216)) * 2 if args.speculative_config else list(range(200, 232))}]

    def traced(fn):
        engine.tracer._file.flush()
        start = len(trace.read_text().splitlines())
        value = fn()
        engine.engine_core.drain()
        engine.tracer._file.flush()
        return value, [json.loads(x) for x in trace.read_text().splitlines()[start:]]

    llm.generate(single, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)  # warm-up
    result: dict = {}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    out, recs = traced(lambda: llm.generate(single, params, use_tqdm=False)[0])
    m = out.metrics
    result["tpot_ms"] = 1e3 * (m.last_token_time - m.first_token_time) / (args.tokens - 1)
    result["single_host"] = host_figures(recs)
    if args.speculative_config:  # tokens per verifying step, from the step trace's spec field
        spec = [d_a for r in recs for d_a in (r.get("spec") or {}).values()]
        result["accepted_per_step"] = sum(a for _, a in spec) / max(len(spec), 1)
    if not args.no_w1:
        params = SamplingParams(max_tokens=args.w1_tokens, ignore_eos=True, temperature=0)
        t0 = time.perf_counter()
        outs, recs = traced(lambda: llm.generate(w1, params, use_tqdm=False))
        wall = time.perf_counter() - t0
        result["w1_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
        result["w1_host"] = host_figures(recs)
    result["dtype"] = str(engine.dtype)
    llm.llm_engine.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--w1-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--speculative-config", default=None, help="n-gram drafts in both modes (JSON)")
    ap.add_argument("--no-w1", action="store_true", help="single stream only")
    ap.add_argument("--one", choices=["sync", "async"], default=None, help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return 0

    child_args = list(sys.argv[1:])  # a child measures and prints; only this process writes --json
    results: dict[str, dict[str, list]] = {m: {"tpot_ms": [], "w1_tok_s": [], "single_host": [], "w1_host": [],
                                               "accepted_per_step": []}
                                           for m in ("sync", "async")}  # fmt: skip
    dtype = None
    for rnd in range(args.rounds):
        order = ("sync", "async") if rnd % 2 == 0 else ("async", "sync")
        for mode in order:
            done = subprocess.run([sys.executable, __file__, *child_args, "--one", mode], capture_output=True,
                                  text=True, check=False)  # fmt: skip
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(done.stdout + done.stderr)
                raise SystemExit(f"the {mode} run failed (exit {done.returncode})")
            r = json.loads(line[len("RESULT "):])
            dtype = r.pop("dtype")
            for key, value in r.items():
                results[mode][key].append(value)
            w1 = f", W1-style {r['w1_tok_s']:.1f} tok/s" if "w1_tok_s" in r else ""
            print(f"round {rnd} {mode:5s}: TPOT {r['tpot_ms']:.2f} ms{w1}", flush=True)

    summary = {}
    for mode, r in results.items():
        summary[mode] = {
            "tpot_ms_median": statistics.median(r["tpot_ms"]),
            "single_host": {k: statistics.median(h[k] for h in r["single_host"]) for k in r["single_host"][0]},
        }
        if r["w1_tok_s"]:
            summary[mode]["w1_tok_s_median"] = statistics.median(r["w1_tok_s"])
            summary[mode]["w1_host"] = {k: statistics.median(h[k] for h in r["w1_host"]) for k in r["w1_host"][0]}
        if r["accepted_per_step"]:
            summary[mode]["accepted_drafts_per_verifying_step"] = statistics.median(r["accepted_per_step"])
    report = {"args": vars(args), "dtype": dtype, "processes": "fresh per mode and round", "rounds": results,
              "summary": summary}  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
