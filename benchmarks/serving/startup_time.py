"""`tokenloom serve` start-up: from launch to the first 200 on /health, for one or more source trees,
runs alternating between them (A, B, A, B, ...) so that a machine getting busier favours neither.

Also reported: the CPU seconds the server's process tree (the API process and its engine process) had
used by then, read from /proc — a figure that depends much less on what else the machine runs than
the wall time does. Each tree runs with PYTHONPATH set to it, so a second checkout of an older commit
(`git worktree add /tmp/old HEAD~5`) is the "before" side.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/serving/startup_time.py --runs 7 /tmp/old $PWD

Anything after `--` goes to `tokenloom serve` (a model, engine options). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """utime + stime (+ reaped children's) of `pid` and every live descendant."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / TICKS
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(tree: str, serve_args: list[str], timeout_s: float) -> tuple[float, float]:
    """(seconds to healthy, CPU seconds used by then) of one `tokenloom serve` run from `tree`."""
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port), *serve_args],
                            cwd=tree, env={**os.environ, "PYTHONPATH": tree}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: the server exited with code {proc.returncode}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{tree}: not healthy after {timeout_s:g} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        return time.monotonic() - t0, tree_cpu_s(proc.pid)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees", nargs="+", help="source trees (checkouts) to start the server from")
    p.add_argument("--runs", type=int, default=5, help="starts per tree")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    args = p.parse_args(argv)
    results: dict[str, list[tuple[float, float]]] = {t: [] for t in args.trees}
    for i in range(args.runs):
        for tree in args.trees:
            wall, cpu = one_start(tree, serve_args, args.timeout)
            results[tree].append((wall, cpu))
            print(f"run {i + 1}/{args.runs} {tree}: {wall:.2f} s to healthy, {cpu:.2f} CPU s, "
                  f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    for tree, rows in results.items():
        print(f"{tree}: median {statistics.median(r[0] for r in rows):.2f} s to healthy "
              f"(min {min(r[0] for r in rows):.2f}), {statistics.median(r[1] for r in rows):.2f} CPU s, "
              f"{len(rows)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
