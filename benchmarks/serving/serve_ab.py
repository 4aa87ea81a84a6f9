"""Serving latency of two `tokenloom serve` configurations on one workload, alternating A, B, B, A, ...

Each round starts a fresh server with the round's flags, replays the same workload with
`tokenloom bench serve` (open loop: every request sent at its arrival time, streamed), stops the
server, then does the same for the other configuration; the order flips every round so that a
machine slowing down over the run does not favour either side. Reported: the medians over rounds of
TTFT, ITL and TPOT p50/p99 (vLLM's `bench serve` definitions) and output tokens/s, with every
round's figures beside them.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serving/serve_ab.py \\
        --a= --b=--async-scheduling --labels sync,async --rounds 2 --json out.json \\
        -- --dataset-name jsonl --dataset-path W2.jsonl

Anything after `--` goes to `tokenloom bench serve` unchanged (workload options). The workload
files of `../shared/anchors/workloads.py` (W2: Poisson arrivals, prompts 32-1,024, outputs 16-256)
are read with `--dataset-name jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.real_models.multi_stream import free_port, wait_ready  # noqa: E402  (server start-up helpers)

FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_e2el_ms", "output_throughput", "completed", "failed")


def one_run(server_flags: list[str], bench_args: list[str], log_path: Path) -> dict:
    """Start `tokenloom serve` with the flags, replay the workload, stop it; the bench's metrics."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port), *server_flags]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc)
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "result.json"
                subprocess.run(
                    [sys.executable, "-m", "tokenloom.cli", "bench", "serve", "--base-url",
                     f"http://127.0.0.1:{port}", "--disable-tqdm", "--result-file", str(result), *bench_args],
                    check=True, env=env, stdout=subprocess.DEVNULL)
                metrics = json.loads(result.read_text())
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {k: metrics.get(k) for k in FIGURES}


def main() -> None:
    argv = sys.argv[1:]
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="", help="serve flags of A, one shell-quoted string (--a=--flag ...)")
    ap.add_argument("--b", default="", help="serve flags of configuration B")
    ap.add_argument("--common", default="", help="serve flags both configurations get")
    ap.add_argument("--labels", default="A,B")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default=None, help="keep each server's log here (default: a temp dir)")
    args = ap.parse_args(argv)
    labels = args.labels.split(",")
    if len(labels) != 2:
        ap.error("--labels takes two names, e.g. sync,async")
    configs = {labels[0]: shlex.split(args.common) + shlex.split(args.a),
               labels[1]: shlex.split(args.common) + shlex.split(args.b)}
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_ab_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict]] = {label: [] for label in labels}
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            row = one_run(configs[label], bench_args, log_dir / f"{label}_{r}.log")
            rounds[label].append(row)
            print(f"round {r} {label}: " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    summary = {label: {k: statistics.median(row[k] for row in rows if row[k] is not None)
                       for k in FIGURES if any(row[k] is not None for row in rows)}
               for label, rows in rounds.items()}
    out = {"configs": configs, "bench_args": bench_args, "rounds": rounds, "median": summary}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
