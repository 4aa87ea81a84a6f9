"""TTFT of a repeated long prompt: cold, from the pool's prefix cache, from the host tier, from the disk
tier, and from the disk tier after a restart (docs/kv_offload.md).

Three engines on one model: `plain` (no connector: the cold baseline), `host` (--kv-offloading-size, no
directory) and `disk` (a one-block host tier in front of a --kv-offloading-dir, so its hits come from
disk); `disk` is closed and rebuilt on the same directory every round ("restart"). Each round takes a
fresh random prompt and measures, in this order: plain cold, host cold, pool hit, host-tier hit (after
reset_prefix_cache), disk cold (it writes the files), disk-tier hit (after reset_prefix_cache), then the
restarted engine's hit. TTFT is the wall time of `LLM.generate` with max_tokens=1. The files stay in the
page cache (nothing here drops it): "disk" is a read of files the OS has cached, as on a warm server.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/kv_cache/offload_ttft.py --prompt-len 2048 \
        --rounds 3 --out docs/figures/kv_offload_ttft.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom import LLM, SamplingParams  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1)
KINDS = ["cold (no connector)", "cold (host tier)", "pool hit", "host tier", "cold (disk tier)", "disk tier",
         "after restart"]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], ONE, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="the disk tier's directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    disk_dir = args.dir or tempfile.mkdtemp(prefix="tokenloom-kv-")
    common = dict(max_model_len=args.prompt_len + 64)
    disk_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"num_cpu_blocks": 1, "disk_dir": disk_dir,
                                                 "disk_bytes_to_use": 8 << 30}}
    plain = LLM(args.model, **common)
    host = LLM(args.model, kv_offloading_size=args.host_gib, **common)
    disk = LLM(args.model, kv_transfer_config=disk_config, **common)
    vocab = plain.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    rows: list[dict[str, float]] = []
    for r in range(args.rounds):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)]
        row: dict[str, float] = {}
        cached: dict[str, int] = {}
        row[KINDS[0]], cached[KINDS[0]] = ttft(plain, prompt)
        row[KINDS[1]], cached[KINDS[1]] = ttft(host, prompt)
        row[KINDS[2]], cached[KINDS[2]] = ttft(host, prompt)
        assert host.llm_engine.scheduler.reset_prefix_cache()
        row[KINDS[3]], cached[KINDS[3]] = ttft(host, prompt)
        row[KINDS[4]], cached[KINDS[4]] = ttft(disk, prompt)
        assert disk.llm_engine.scheduler.reset_prefix_cache()
        row[KINDS[5]], cached[KINDS[5]] = ttft(disk, prompt)
        disk.llm_engine.close()
        disk = LLM(args.model, kv_transfer_config=disk_config, **common)
        row[KINDS[6]], cached[KINDS[6]] = ttft(disk, prompt)
        print(f"round {r + 1}: " + ", ".join(f"{k} {row[k] * 1000:.0f} ms ({cached[k]} cached)" for k in KINDS),
              flush=True)
        rows.append(row)
    print(f"\n{args.prompt_len}-token prompt, median of {args.rounds} rounds (ratio to cold without a connector, "
          "per round):\n")
    print("| | TTFT ms | / cold |\n|---|---:|---:|")
    summary = {}
    for k in KINDS:
        ms = statistics.median(row[k] for row in rows) * 1000
        ratio = statistics.median(row[k] / row[KINDS[0]] for row in rows)
        summary[k] = {"ttft_ms": round(ms, 1), "ratio_to_cold": round(ratio, 4)}
        print(f"| {k} | {ms:.0f} | {ratio:.1%} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"prompt_len": args.prompt_len, "rounds": rows, "median": summary,
                                              "model": args.model or "SmolLM2-135M-Instruct (default GGUF)"},
                                             indent=1) + "\n")
    disk.llm_engine.close()


if __name__ == "__main__":
    main()
