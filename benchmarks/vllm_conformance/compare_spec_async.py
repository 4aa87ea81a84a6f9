"""Differential check: random spec/async traces through tokenloom's replay and vLLM's scheduler.

    PYTHONPATH=$PWD python benchmarks/vllm_conformance/compare_spec_async.py --n 200 --seed 1 \\
        --vllm-python "env VLLM_TARGET_DEVICE=cpu PYTHONPATH=/work/vllm-src:/tmp/vdeps python" \\
        --model-dir /tmp/vh/tiny [--save-dir benchmarks/vllm_conformance/cases_spec_async]

Generates traces (K in 0..4, async on/off, tight budgets and pools so that drafts are cut, requests
are preempted with a step in flight and finish with output in flight, prefix caching on/off), runs
them through vllm_replay_spec.py in one vLLM process, replays them with tokenloom, and compares the
fields the reference compares (scheduled with its order, preempted, finished, num_free_blocks,
cached_tokens with prefix caching, spec, events, placeholders, summary.spec_decoding). With
--save-dir, every compared trace is saved with vLLM's result (the cases tests/ replays offline).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenloom.config import ConfigError
from tokenloom.core.replay import replay

HERE = Path(__file__).resolve().parent
FIELDS = ("scheduled", "preempted", "finished", "num_free_blocks", "spec", "events", "placeholders")


def random_trace(rng: random.Random) -> dict[str, Any]:
    k = rng.choice([0, 1, 2, 3, 4]) if rng.random() < 0.3 else rng.choice([2, 3])
    block_size = rng.choice([2, 4, 8])
    max_model_len = rng.choice([24, 32, 48, 64])
    cfg = {
        "max_num_batched_tokens": rng.choice([4, 6, 8, 12, 16, 32]),
        "max_num_seqs": rng.choice([1, 2, 3, 4, 8]),
        "enable_chunked_prefill": rng.random() < 0.85,
        "long_prefill_token_threshold": rng.choice([0, 0, 0, 8, 16]),
        "block_size": block_size,
        "num_blocks": rng.choice([6, 8, 10, 14, 20, 40]),
        "policy": rng.choice(["fcfs", "fcfs", "priority"]),
        "enable_prefix_caching": rng.random() < 0.5,
        "max_model_len": max_model_len,
        "num_speculative_tokens": k,
        "async_scheduling": rng.random() < 0.75,
    }
    if not cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], max_model_len)
    if 0 < cfg["long_prefill_token_threshold"] < 1 + k:
        cfg["long_prefill_token_threshold"] = 0
    shared = [rng.randrange(100, 140) for _ in range(16)]
    requests = []
    for i in range(rng.randint(1, 6)):
        n = rng.choice([1, 1, 2, 3, 5, 8, 12, 17, 20])
        prompt = (shared[: rng.randint(0, 16)] if rng.random() < 0.4 else []) + [
            rng.randrange(100, 140) for _ in range(n)]
        prompt = prompt[: max_model_len - 2] or [101]
        requests.append({
            "id": f"r{i}", "arrival_step": rng.choice([0, 0, 0, 1, 2, 3, 5, 8]), "prompt_token_ids": prompt,
            "max_tokens": rng.choice([1, 2, 3, 4, 6, 9, 14]), "priority": rng.choice([0, 0, 1, 2]),
            "drafts": [rng.randint(0, k + 1) for _ in range(rng.randint(0, 3))],
            "accept": [rng.randint(0, k + 1) for _ in range(rng.randint(0, 4))],
        })
    return {"config": cfg, "requests": requests}


def compare(trace: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    ours = replay(trace)
    a, b = ours["steps"], theirs["steps"]
    prefix = trace["config"].get("enable_prefix_caching", True)
    for i, (x, y) in enumerate(zip(a, b)):
        for f in FIELDS + (("cached_tokens",) if prefix else ()):
            if f in y and x.get(f) != y[f]:
                return f"step {i} {f}: tokenloom {x.get(f)!r} != vLLM {y[f]!r}"
        if list(x["scheduled"]) != list(y["scheduled"]):
            return f"step {i}: scheduling order differs"
    if len(a) != len(b):
        return f"tokenloom ran {len(a)} steps, vLLM {len(b)}"
    if ours["summary"]["rejected"] != theirs["summary"]["rejected"]:
        return "rejected differ"
    mine, vllm = ours["summary"].get("spec_decoding"), theirs["summary"].get("spec_decoding")
    if vllm is not None and mine != vllm:
        return f"spec_decoding {mine} != {vllm}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--save-dir")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    traces = []
    while len(traces) < args.n:
        t = random_trace(rng)
        try:
            replay(t)
        except ConfigError:
            continue
        traces.append(t)
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp, "in.json"), Path(tmp, "out.json")
        inp.write_text(json.dumps(traces))
        cmd = [*shlex.split(args.vllm_python), str(HERE / "vllm_replay_spec.py"), "--batch", str(inp), "-o", str(out),
               "--model-dir", args.model_dir]
        subprocess.run(cmd, check=True, cwd=tmp)
        results = json.loads(out.read_text())
    bad = 0
    for i, (t, r) in enumerate(zip(traces, results)):
        if "error" in r:
            print(f"#{i}: vLLM error {r['error']}")
            bad += 1
            continue
        diff = compare(t, r)
        if diff:
            bad += 1
            print(f"#{i}: {diff}\n  {json.dumps(t)}")
        elif args.save_dir:
            Path(args.save_dir).mkdir(parents=True, exist_ok=True)
            c = t["config"]
            name = f"k{c['num_speculative_tokens']}_{'async' if c['async_scheduling'] else 'sync'}_s{args.seed}_{i:04d}"
            Path(args.save_dir, name + ".json").write_text(json.dumps({"trace": t, "expected": r}, indent=1))
    print(f"{len(traces) - bad}/{len(traces)} traces match vLLM")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
