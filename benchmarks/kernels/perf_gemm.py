"""GEMM rates of SmolLM2-135M's linear shapes: F.linear vs oneDNN pre-packed weights vs int8.

The int8 column is torch._int_mm (oneDNN, AVX512-VNNI) on int8 operands, what `--quantization int8`
runs (its per-row quantization and the scaling back are fused into the neighbouring kernels).

    .venv/bin/python benchmarks/kernels/perf_gemm.py [--threads 2] [--dtype bfloat16] [--m 128,2048]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def bench(fn: Callable[[], object], min_time: float = 0.5, min_iters: int = 5) -> float:
    fn()
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if n >= min_iters and el >= min_time:
            return el / n


def row(m: int, name: str, k: int, n: int, dt: torch.dtype) -> str:
    x = torch.randn(m, k).to(dt)
    w = (torch.randn(n, k) * 0.05).to(dt)
    flops = 2 * m * k * n
    with torch.inference_mode():
        t_lin = bench(lambda: F.linear(x, w))
        out = f"M={m:5d} {name:8s} K={k:5d} N={n:6d}  F.linear {flops / t_lin / 1e9:7.1f} GF/s ({t_lin * 1e3:7.3f} ms)"
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            t_pk = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            out += f"  packed {flops / t_pk / 1e9:7.1f} GF/s ({t_pk * 1e3:7.3f} ms)"
        except RuntimeError as e:
            out += f"  packed: {str(e)[:80]}"
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        wq = torch.randint(-127, 128, (k, n), dtype=torch.int8)
        t_i8 = bench(lambda: torch._int_mm(xq, wq))
        out += f"  int8 {flops / t_i8 / 1e9:7.1f} GOP/s ({t_i8 * 1e3:7.3f} ms)"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--m", default="128,2048")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    for m in [int(x) for x in a.m.split(",")]:
        for name, (k, n) in SHAPES.items():
            if name != "lm_head" or m <= 256:
                print(row(m, name, k, n, dt), flush=True)


if __name__ == "__main__":
    main()
