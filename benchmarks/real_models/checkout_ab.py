"""single_stream.py from two checkouts, A (e.g. main) and B (a branch), alternated: before / after.

Each pair runs `single_stream.py --rounds 1` once from each checkout (A first in even pairs, B first
in odd ones), every run a fresh process with its own compiled kernels (`--cache-a` / `--cache-b`:
TOKENLOOM_CACHE_DIR of each, so the two builds never share an entry), and llama-bench in every run
as the machine's yardstick. Reported: each version's decode tok/s per run, the medians, the median
of the per-pair B / A ratios, and each version's median ratio to llama.cpp; the load averages before
and after. Extra arguments after `--` go to single_stream.py.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/real_models/checkout_ab.py \\
        --a ../main --b . --cache-a /tmp/tl-a --cache-b /tmp/tl-b --pairs 3 --json OUT.json -- \\
        MODEL.gguf --cpu-isa avx2 --llama-bench $LB/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one_run(checkout: Path, cache: str, args: list[str]) -> dict:
    """One single_stream.py run (one round) from `checkout`, its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "PYTHONPATH": str(checkout), "TOKENLOOM_CACHE_DIR": cache}
        subprocess.run([sys.executable, str(checkout / "benchmarks/real_models/single_stream.py"), *args,
                        "--rounds", "1", "--json", str(out)], env=env, check=True, cwd=checkout)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="checkout A (before)")
    ap.add_argument("--b", type=Path, required=True, help="checkout B (after)")
    ap.add_argument("--cache-a", required=True, help="TOKENLOOM_CACHE_DIR for A's kernels")
    ap.add_argument("--cache-b", required=True, help="TOKENLOOM_CACHE_DIR for B's kernels")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then single_stream.py's arguments")
    a = ap.parse_args()
    args = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    load_start = os.getloadavg()
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for p in range(a.pairs):
        for name in ("A", "B") if p % 2 == 0 else ("B", "A"):
            checkout, cache = (a.a, a.cache_a) if name == "A" else (a.b, a.cache_b)
            runs[name].append(one_run(checkout.resolve(), cache, args))
            r = runs[name][-1]
            print(f"pair {p} {name}: tokenloom {r['tokenloom_tok_s']:.2f} tok/s, llama.cpp "
                  f"{r.get('llamacpp_tok_s', float('nan')):.2f}", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    result = {
        "a": str(a.a), "b": str(a.b), "single_stream_args": args, "pairs": a.pairs,
        "a_tok_s": [round(r["tokenloom_tok_s"], 2) for r in runs["A"]],
        "b_tok_s": [round(r["tokenloom_tok_s"], 2) for r in runs["B"]],
        "a_median_tok_s": round(med("A", "tokenloom_tok_s"), 2),
        "b_median_tok_s": round(med("B", "tokenloom_tok_s"), 2),
        "b_over_a_median_of_pairs": round(statistics.median(
            rb["tokenloom_tok_s"] / ra["tokenloom_tok_s"] for ra, rb in zip(runs["A"], runs["B"])), 4),
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
    }
    if all("tokenloom_prefill_tok_s" in r for rs in runs.values() for r in rs):  # --ttft-prompt-len given
        result["a_prefill_tok_s"] = [round(r["tokenloom_prefill_tok_s"], 1) for r in runs["A"]]
        result["b_prefill_tok_s"] = [round(r["tokenloom_prefill_tok_s"], 1) for r in runs["B"]]
        result["b_over_a_prefill_median_of_pairs"] = round(statistics.median(
            rb["tokenloom_prefill_tok_s"] / ra["tokenloom_prefill_tok_s"] for ra, rb in zip(runs["A"], runs["B"])), 4)
    if all("llamacpp_tok_s" in r for rs in runs.values() for r in rs):
        result["llamacpp_tok_s"] = [round(r["llamacpp_tok_s"], 2) for rs in runs.values() for r in rs]
        result["a_ratio_to_llamacpp"] = round(med("A", "ratio"), 4)
        result["b_ratio_to_llamacpp"] = round(med("B", "ratio"), 4)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
