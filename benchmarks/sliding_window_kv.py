"""KV blocks one long sequence holds, with and without sliding-window freeing (deterministic: the
KV managers of tokenloom/core only, no model). Mistral-7B-v0.1's shape of the problem by default:
window 4096, block 16, chunked prefill of 512-token chunks, then decodes.

    PYTHONPATH=$PWD python benchmarks/sliding_window_kv.py [--window 4096] [--prompt 16384] [--decode 1024]
"""

from __future__ import annotations

import argparse

from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.request import Request
from tokenloom.core.sliding_window import SlidingWindowKVCacheManager
from tokenloom.sampling_params import SamplingParams


def held_blocks(manager: KVCacheManager, prompt: int, decode: int, chunk: int, block: int) -> list[int]:
    """Blocks the request holds after each step (NULL_BLOCK entries are not blocks)."""
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=decode, ignore_eos=True))
    req.set_block_size(block)
    held = []
    while req.num_computed_tokens < prompt + decode:
        n = min(chunk, prompt - req.num_computed_tokens) if req.num_computed_tokens < prompt else 1
        if req.num_computed_tokens >= prompt:
            req.append_output_token_ids(7)
        assert manager.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        held.append(manager.num_blocks - manager.block_pool.get_num_free_blocks())
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    total = a.prompt + a.decode
    pool = total // a.block_size + 8
    full = held_blocks(KVCacheManager(pool, a.block_size, total + 1, enable_caching=False),
                       a.prompt, a.decode, a.chunk, a.block_size)
    swa = held_blocks(SlidingWindowKVCacheManager(pool, a.block_size, total + 1, a.window, a.chunk,
                                                  enable_caching=False),
                      a.prompt, a.decode, a.chunk, a.block_size)
    print(f"sequence {a.prompt} + {a.decode} tokens, window {a.window}, block {a.block_size}, chunk {a.chunk}")
    print(f"{'':24} {'peak blocks':>12} {'at the end':>11}")
    print(f"{'full attention (kept)':24} {max(full):>12} {full[-1]:>11}")
    print(f"{'sliding window (freed)':24} {max(swa):>12} {swa[-1]:>11}")


if __name__ == "__main__":
    main()
