"""Prefill GEMM rate of the GGUF kernels on a model's own weights: one layer's linears at M rows.

For each quantized linear of layer `--layer` (q, k, v, o, gate, up, down; the file's own types),
kept quantized in the 8-row layout, times the batched GEMM `gguf_gemm_packed` (what GGUFLinear runs
for prefill) on M random activation rows and prints ms and GFLOP/s (2 M N K / time), plus the
layer's total. Best of `--reps` (robust on a shared machine). With `--tiles`, also the small-batch
tile kernel `gguf_linear_packed` (the ratio: its time / the GEMM's); with `--dequant`, dequantize +
F.linear, the old fallback.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant/gguf_prefill_gemm.py MODEL.gguf [--m 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.model.gguf_weights import GGUFWeight, load_gguf_quantized
from tokenloom.model.loader import default_model_path

NAMES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj"]


CLOCK = time.perf_counter


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--m", default="512")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dequant", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="also the small-batch tile kernel (gguf_linear_packed)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (with --threads 1: robust to other processes on the cores)")
    a = ap.parse_args()
    global CLOCK
    if a.cpu_time:
        CLOCK = time.process_time
    if a.threads:
        torch.set_num_threads(a.threads)
    k = gguf_kernels()
    _, w = load_gguf_quantized(a.model or default_model_path())
    lins = []
    for name in NAMES:
        p = w.get(f"model.layers.{a.layer}.{name}.weight")
        if isinstance(p, GGUFWeight):
            lins.append((name.split(".")[-1], p.repacked(k)))
    for m in [int(v) for v in a.m.split(",")]:
        tot_t = tot_f = 0.0
        for name, p in lins:
            n, kk = p.shape
            x = torch.randn(m, kk)
            out = torch.empty(m, n)
            gemm = k.gguf_gemm_packed if p.packed8 else k.gguf_linear
            t = best(partial(gemm, out, x, p.data, p.qtype, None), a.reps)
            fl = 2 * m * n * kk
            tot_t += t
            tot_f += fl
            line = (f"M={m:5d} {name:10s} {p.qtype!s:>3} N={n:6d} K={kk:5d} packed={int(p.packed8)} "
                    f"{t * 1e3:8.2f} ms {fl / t / 1e9:6.1f} GF/s")
            if a.tiles and p.packed8:
                tt = best(partial(k.gguf_linear_packed, out, x, p.data, p.qtype, None), a.reps)
                line += f" | tile kernel {tt * 1e3:8.2f} ms ({tt / t:.2f}x)"
            if a.dequant:
                td = best(partial(lambda x, p: F.linear(x, p.dequantize()), x, p), a.reps)
                line += f" | dequant+F.linear {td * 1e3:8.2f} ms"
            print(line, flush=True)
        print(f"M={m:5d} layer total {tot_t * 1e3:8.2f} ms {tot_f / tot_t / 1e9:6.1f} GF/s")


if __name__ == "__main__":
    main()
