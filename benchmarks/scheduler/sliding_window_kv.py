"""KV blocks long sequences hold, with and without sliding-window freeing (deterministic: the KV
managers and scheduler of tokenloom/core only, no model).

Uniform window (default): Mistral-7B-v0.1's shape of the problem: window 4096, block 16, chunked
prefill of 512-token chunks, then decodes; one sequence's blocks with every block kept vs freed.

`--model gemma3`: Gemma 3 1B's layer pattern (26 layers, 5 sliding of window 512 to 1 global,
1 KV head of 256, bf16): vLLM's hybrid KV cache groups (7 groups of 4 layers) against one group
keeping every block (--disable-hybrid-kv-cache-manager). Both get the same memory (`--pool-gib`):
a hybrid block holds 4 layers, an all-global block 26. Reported: the blocks one long sequence holds
per group, and, with the real scheduler admitting only what fits whole (scheduler_reserve_full_isl)
and a stand-in runner that samples token 7, how many of `--requests` long requests run at once,
preemptions, and steps to finish them all.

    PYTHONPATH=$PWD python benchmarks/scheduler/sliding_window_kv.py [--window 4096] [--prompt 16384] [--decode 1024]
    PYTHONPATH=$PWD python benchmarks/scheduler/sliding_window_kv.py --model gemma3 [--prompt 8192] [--decode 1024]
"""

from __future__ import annotations

import argparse

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.kv_cache_groups import layers_per_block, make_kv_cache_groups
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.outputs import ModelRunnerOutput
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sliding_window import SlidingWindowKVCacheManager
from tokenloom.sampling_params import SamplingParams

# Gemma 3 1B (google/gemma-3-1b-it config.json): 26 layers, sliding_window 512, sliding_window_pattern 6,
# num_key_value_heads 1, head_dim 256.
GEMMA3_1B = dict(layers=26, window=512, pattern=6, kv_heads=1, head_dim=256)


def held_blocks(manager: KVCacheManager, prompt: int, decode: int, chunk: int, block: int) -> list[list[int]]:
    """Blocks the request holds in each group after each step (NULL_BLOCK entries are not blocks)."""
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=decode, ignore_eos=True))
    req.set_block_size(block)
    held = []
    while req.num_computed_tokens < prompt + decode:
        n = min(chunk, prompt - req.num_computed_tokens) if req.num_computed_tokens < prompt else 1
        if req.num_computed_tokens >= prompt:
            req.append_output_token_ids(7)
        assert manager.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        held.append(manager.num_blocks_held_per_group("r"))
    return held


def uniform_window(a: argparse.Namespace) -> None:
    total = a.prompt + a.decode
    pool = total // a.block_size + 8
    full = held_blocks(KVCacheManager(pool, a.block_size, total + 1, enable_caching=False),
                       a.prompt, a.decode, a.chunk, a.block_size)
    swa = held_blocks(SlidingWindowKVCacheManager(pool, a.block_size, total + 1, a.window, a.chunk,
                                                  enable_caching=False),
                      a.prompt, a.decode, a.chunk, a.block_size)
    print(f"sequence {a.prompt} + {a.decode} tokens, window {a.window}, block {a.block_size}, chunk {a.chunk}")
    print(f"{'':24} {'peak blocks':>12} {'at the end':>11}")
    print(f"{'full attention (kept)':24} {max(h[0] for h in full):>12} {full[-1][0]:>11}")
    print(f"{'sliding window (freed)':24} {max(h[0] for h in swa):>12} {swa[-1][0]:>11}")


def run_requests(windows: list[int | None], hybrid: bool, num_blocks: int, a: argparse.Namespace) -> dict[str, int]:
    """The scheduler serving `a.requests` long requests to the end: most running at once, preemptions,
    steps."""
    total = a.prompt + a.decode
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=a.chunk, max_num_seqs=256, max_model_len=total,
                        scheduler_reserve_full_isl=True),
        CacheConfig(block_size=a.block_size, num_blocks=num_blocks, enable_prefix_caching=False,
                    layer_windows=tuple(windows), disable_hybrid_kv_cache_manager=not hybrid),
        clock=lambda: 0.0,
    )
    for i in range(a.requests):
        tokens = [(i * 7919 + j) % 50000 + 1 for j in range(a.prompt)]
        sched.add_request(Request(f"r{i}", tokens, SamplingParams(max_tokens=a.decode, ignore_eos=True)))
    most = preempted = steps = 0
    while sched.has_requests():
        so = sched.schedule()
        steps += 1
        most = max(most, len(sched.running))
        preempted += len(so.preempted_req_ids)
        rids = list(so.num_scheduled_tokens)
        done = [r for r in rids if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens]
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=[[7] if r in done else [] for r in rids]))
    return {"most running": most, "preemptions": preempted, "steps": steps}


def gemma3(a: argparse.Namespace) -> None:
    m = GEMMA3_1B
    windows = [m["window"] if (i + 1) % m["pattern"] else None for i in range(m["layers"])]
    groups = make_kv_cache_groups(windows)
    per = layers_per_block(groups)
    layer_block_bytes = 2 * a.block_size * m["kv_heads"] * m["head_dim"] * 2  # K and V, bf16
    pool_bytes = int(a.pool_gib * 2**30)
    blocks = {"hybrid": pool_bytes // (layer_block_bytes * per),
              "all-global": pool_bytes // (layer_block_bytes * m["layers"])}
    total = a.prompt + a.decode
    print(f"Gemma 3 1B layers: {m['layers']} ({sum(w is not None for w in windows)} sliding, window {m['window']}), "
          f"block {a.block_size}, chunk {a.chunk}; sequence {a.prompt} + {a.decode} tokens")
    print(f"hybrid: {len(groups)} groups of {per} layers ({sum(g.sliding_window is not None for g in groups)} "
          f"sliding, 1 full), a block = {per} layers; all-global: 1 group, a block = {m['layers']} layers")
    print()
    hybrid = KVCacheManager(10**6, a.block_size, total + 1, enable_caching=False, kv_cache_groups=groups,
                            max_num_batched_tokens=a.chunk)
    kept = KVCacheManager(10**6, a.block_size, total + 1, enable_caching=False)
    h, k = held_blocks(hybrid, a.prompt, a.decode, a.chunk, a.block_size), \
        held_blocks(kept, a.prompt, a.decode, a.chunk, a.block_size)
    peak_h = [max(step[g] for step in h) for g in range(len(groups))]
    print("one sequence, blocks held          peak   at the end   layer-blocks at peak")
    for g, group in enumerate(groups):
        kind = f"sliding group {g}" if group.sliding_window else f"full group {g}"
        print(f"  hybrid {kind:24} {peak_h[g]:>6} {h[-1][g]:>12}")
    print(f"  hybrid, all groups{'':13} {max(sum(s) for s in h):>6} {sum(h[-1]):>12} "
          f"{max(sum(s) for s in h) * per:>22}")
    print(f"  all-global (every block kept)    {max(s[0] for s in k):>6} {k[-1][0]:>12} "
          f"{max(s[0] for s in k) * m['layers']:>22}")
    fit_h, fit_k = blocks["hybrid"] // max(sum(s) for s in h), blocks["all-global"] // max(s[0] for s in k)
    print(f"sequences that fit in a {a.pool_gib:g} GiB pool at their peak: hybrid {fit_h}, all-global {fit_k} "
          f"({fit_h / fit_k:.1f}x)")
    print()
    print(f"{a.requests} requests in a {a.pool_gib:g} GiB pool (admitted only when the whole prompt fits)")
    print(f"{'':14} {'blocks':>8} {'most running':>13} {'preemptions':>12} {'steps':>7}")
    for name, on in (("hybrid", True), ("all-global", False)):
        r = run_requests(windows, on, blocks[name], a)
        print(f"{name:14} {blocks[name]:>8} {r['most running']:>13} {r['preemptions']:>12} {r['steps']:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["uniform", "gemma3"], default="uniform")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=None, help="default: 16384 (uniform), 8192 (gemma3)")
    ap.add_argument("--decode", type=int, default=None, help="default: 1024")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-gib", type=float, default=2.0, help="gemma3: KV memory both layouts get")
    ap.add_argument("--requests", type=int, default=48, help="gemma3: long requests served")
    a = ap.parse_args()
    uniform = a.model == "uniform"
    a.prompt = a.prompt if a.prompt is not None else (16384 if uniform else 8192)
    a.decode = a.decode if a.decode is not None else 1024
    (uniform_window if uniform else gemma3)(a)


if __name__ == "__main__":
    main()
