"""A multi-turn chat workload whose history exceeds the KV pool, with and without the offloading tiers:
the prefix-cache hit rate (cached / prompt tokens) and TTFT p50 / p99 per turn (docs/kv_offload.md).

C conversations take turns round-robin; each turn sends the whole history (earlier turns' user
messages and answers, as token ids) plus a new user message, and gets a short answer. The pool
(`--num-blocks`) holds fewer tokens than the conversations' histories together, so by the time a
conversation comes back its history has been evicted from the pool: without tiers it is recomputed,
with `--kv-offloading-size` it comes back from the host tier, and with a disk tier behind a one-block
host tier (`--kv-offloading-dir`'s files; a fresh directory in /tmp) it comes back from disk. The
engines (`--configs`) alternate turn by turn (A, B, C, A, B, C, ...) on the same conversation, so a
machine getting busier favours none. TTFT is the wall time of `LLM.generate` with max_tokens=1 for the
turn's prompt (the answer is then generated with a second call that hits the pool).

`disk-async` is the disk tier with `load_async` (the files read on a background thread while the request
waits in WAITING_FOR_REMOTE_KVS). One request at a time gives such a load nothing to overlap with, so
`--concurrent` sends every conversation's turn of a round at once instead (one `LLM.generate` of C
requests with the answer's max_tokens, engines alternating round by round): TTFT is then each request's
own (RequestOutput.metrics: first token - arrival), and a load can run beside the others' prefills.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/kv_cache/multiturn_tiers.py --conversations 4 \
        --turns 5 --user-tokens 256 --answer-tokens 32 --num-blocks 160 --out docs/figures/kv_offload_multiturn.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom import LLM, SamplingParams  # noqa: E402
from tokenloom.workload.metrics import percentile  # noqa: E402

# The engines the workload runs on, by --configs name: (label, LLM options beyond the pool's).
CONFIGS = ("pool", "host", "disk", "disk-async")


def engine_options(name: str, host_gib: float, disk_dir: str) -> tuple[str, dict]:
    """`disk_dir`: this engine's own directory (one engine per directory)."""
    if name == "pool":
        return "pool only", {}
    if name == "host":
        return "pool + host tier", {"kv_offloading_size": host_gib}
    if name in ("disk", "disk-async"):
        # A one-block host tier: every hit that left the pool is read back from the files.
        extra = {"num_cpu_blocks": 1, "disk_dir": disk_dir, "load_async": name == "disk-async"}
        label = "pool + disk tier" + (", async loads" if name == "disk-async" else "")
        return label, {"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                                           "kv_role": "kv_both", "kv_connector_extra_config": extra}}
    raise SystemExit(f"--configs: unknown engine {name!r} (one of {', '.join(CONFIGS)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=160, help="the pool, in blocks of 16 tokens")
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"engines, comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--concurrent", action="store_true", help="send a round's turns together (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    max_len = args.turns * (args.user_tokens + args.answer_tokens) + 64
    common = dict(num_blocks=args.num_blocks, max_model_len=max_len)
    disk_dir = tempfile.mkdtemp(prefix="tl-multiturn-kv-")
    engines = {}
    for name in args.configs.split(","):
        label, options = engine_options(name.strip(), args.host_gib, str(Path(disk_dir) / name.strip()))
        engines[label] = LLM(args.model, **common, **options)
    vocab = next(iter(engines.values())).llm_engine.model_config.vocab_size
    rng = random.Random(0)
    histories = {name: [[] for _ in range(args.conversations)] for name in engines}
    user = [[[rng.randrange(100, vocab - 100) for _ in range(args.user_tokens)] for _ in range(args.turns)]
            for _ in range(args.conversations)]
    figures = {name: {"ttft": [], "prompt": 0, "cached": 0} for name in engines}
    one = SamplingParams(temperature=0.0, max_tokens=1)
    answer = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    for turn in range(args.turns):
        if args.concurrent:
            for name, llm in engines.items():
                prompts = [histories[name][c] + user[c][turn] for c in range(args.conversations)]
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], answer, use_tqdm=False)
                for c, (prompt, out) in enumerate(zip(prompts, outs)):
                    figures[name]["ttft"].append(out.metrics.time_to_first_token)
                    figures[name]["prompt"] += len(prompt)
                    figures[name]["cached"] += out.num_cached_tokens
                    histories[name][c] = prompt + list(out.outputs[0].token_ids)
        else:
            for c in range(args.conversations):
                for name, llm in engines.items():
                    prompt = histories[name][c] + user[c][turn]
                    t0 = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)[0]
                    figures[name]["ttft"].append(time.perf_counter() - t0)
                    figures[name]["prompt"] += len(prompt)
                    figures[name]["cached"] += out.num_cached_tokens
                    reply = llm.generate([{"prompt_token_ids": prompt}], answer, use_tqdm=False)[0]
                    histories[name][c] = prompt + list(reply.outputs[0].token_ids)
        print(f"turn {turn + 1}/{args.turns} done", flush=True)
    # Every engine must have produced the same conversations (greedy): a tier that served bad KV shows here.
    first = next(iter(histories.values()))
    same = {name: h == first for name, h in histories.items()}
    print(f"\n{args.conversations} conversations x {args.turns} turns{' (concurrent)' if args.concurrent else ''}, "
          f"{args.user_tokens} user + {args.answer_tokens} answer tokens a turn, pool {args.num_blocks * 16} tokens; "
          f"same tokens as the first engine: {same}\n")
    print("| | hit rate | TTFT p50 ms | TTFT p99 ms |\n|---|---:|---:|---:|")
    summary = {}
    for name, f in figures.items():
        ttft = sorted(f["ttft"])
        summary[name] = {"hit_rate": round(f["cached"] / f["prompt"], 4), "same_tokens": same[name],
                         "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
                         "ttft_p99_ms": round(percentile(ttft, 99) * 1000, 1),
                         "ttft_ms_in_order": [round(t * 1000, 1) for t in f["ttft"]]}
        s = summary[name]
        print(f"| {name} | {s['hit_rate']:.1%} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} |")
    shutil.rmtree(disk_dir, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
