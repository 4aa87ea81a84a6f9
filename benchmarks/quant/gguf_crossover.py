"""Where dequantize-then-GEMM overtakes the GGUF kernels: time one layer's four linears of the
default model (Q4_1, 8-row layout) both ways at growing row counts, in the run dtype.

    .venv/bin/python benchmarks/quant/gguf_crossover.py [--rows 1,8,16,32,64,128,256] [--dtype float32]

GGUFLinear switches the row-at-a-time kernel at TOKENLOOM_GGUF_DEQUANT_ROWS (default 32, from this
measurement); the 8-row layouts at TOKENLOOM_GGUF_PACKED_DEQUANT_ROWS (4096: see docs/performance.md).
Times are the best of several repetitions (robust on a shared machine).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.model.gguf_weights import GGUFLinear, load_gguf_quantized
from tokenloom.model.loader import default_model_path


def best(fn, reps: int = 15) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,48,64,128,256")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    k = gguf_kernels()
    _, w = load_gguf_quantized(default_model_path())
    p = "model.layers.0."
    lins = [GGUFLinear.from_weights([w[p + n] for n in names], [None] * len(names), k) for names in (
        ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        ["self_attn.o_proj.weight"], ["mlp.gate_proj.weight", "mlp.up_proj.weight"], ["mlp.down_proj.weight"])]
    print(f"{'rows':>5} {'kernel ms':>10} {'dequant+GEMM ms':>16}")
    for m in [int(r) for r in a.rows.split(",")]:
        xs = [torch.randn(m, lin.in_features).to(dtype) for lin in lins]

        def kernel(xs: list[torch.Tensor] = xs) -> None:
            for lin, x in zip(lins, xs):
                lin_out = torch.empty(x.shape[0], lin.out_features, dtype=torch.float32)
                col = 0
                for part in lin.parts:
                    n = part.shape[0]
                    k.gguf_linear_packed(lin_out[:, col:col + n], x.float(), part.data, part.qtype, None)
                    col += n

        def dequant(xs: list[torch.Tensor] = xs) -> None:
            for lin, x in zip(lins, xs):
                F.linear(x, torch.cat([part.dequantize(dtype) for part in lin.parts]))

        print(f"{m:5d} {1e3 * best(kernel):10.3f} {1e3 * best(dequant):16.3f}", flush=True)


if __name__ == "__main__":
    main()
