"""The LoRA product of one decoder layer: the compiled kernel (csrc/lora_kernels.cpp) against the torch
ops (docs/lora.md).

One SmolLM2-135M layer's four LoRA linears (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576),
four rank-8 adapters on every target in bf16 slots (the default model's activations), two step shapes:
a decode step of 16 rows (4 adapters + base round-robin, so every group is scattered) and a prefill
step of 600 rows (requests' spans of 60-120 rows, two spans per adapter). Reports the median time of
`add_lora_linear` per linear and per layer, kernel vs torch, alternated per linear. Timed as the CPU
time of the calling thread (`time.thread_time`), so run it with OMP_NUM_THREADS=1: on a shared
machine that counts this process's work, not the other processes' time slices.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/lora/lora_kernel.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from tokenloom.lora.models import LoRALinear
from tokenloom.lora.punica import PunicaWrapperCPU
from tokenloom.model.lora_kernels import lora_kernels

LINEARS = {"qkv_proj": (576, [("q_proj", 576), ("k_proj", 192), ("v_proj", 192)]),
           "o_proj": (576, [("o_proj", 576)]),
           "gate_up_proj": (576, [("gate_proj", 1536), ("up_proj", 1536)]),
           "down_proj": (1536, [("down_proj", 576)])}
STEPS = {"decode, 16 rows": np.array([i % 5 if i % 5 < 4 else -1 for i in range(16)]),
         "prefill, 600 rows": np.repeat(np.array([0, 1, 2, 3, -1, 0, 1]), [100, 80, 90, 70, 60, 120, 80])}


def median_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernel = lora_kernels()
    if kernel is None:
        raise SystemExit("the LoRA kernel could not be built here")
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict] = {}
    for step, slots in STEPS.items():
        per = {"kernel": {}, "torch": {}}
        for name, (fan_in, slices) in LINEARS.items():
            wrappers = {"kernel": PunicaWrapperCPU(torch.device("cpu"), kernel),
                        "torch": PunicaWrapperCPU(torch.device("cpu"))}
            adapters = [SimpleNamespace(loras={(0, m): SimpleNamespace(
                rank=args.rank, lora_a=torch.randn(args.rank, fan_in, generator=gen) / fan_in**0.5,
                lora_b=torch.randn(size, args.rank, generator=gen) * 0.01, scaling=2.0) for m, size in slices})
                for _ in range(4)]
            x = torch.randn(len(slots), fan_in, generator=gen).bfloat16()
            y = torch.randn(len(slots), sum(s for _, s in slices), generator=gen).bfloat16()
            for how, punica in wrappers.items():
                linear = LoRALinear(punica, 0, slices)
                for slot, adapter in enumerate(adapters):
                    linear.set_slot(slot, adapter, torch.bfloat16, torch.device("cpu"))
                punica.update_metadata(slots)
                call = lambda p=punica, w=linear.weights, x=x, y=y: p.add_lora_linear(y, x, w)  # noqa: E731
                per[how][name] = median_us(call, args.reps)
        for how in per:
            per[how]["layer"] = sum(per[how].values())
        results[step] = per
        print(f"{step}: " + ", ".join(f"{n} {per['torch'][n]:.0f} -> {per['kernel'][n]:.0f} us"
                                      for n in [*LINEARS, "layer"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "threads": torch.get_num_threads(),
                                               "us_per_call": results}, indent=1))


if __name__ == "__main__":
    main()
