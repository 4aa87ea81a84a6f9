"""The fused decode step of a real GGUF from two csrc directories, A and B, in one process, alternated.

Both versions of the GGUF kernels (gguf_kernels.cpp + fused_decode.cpp of each directory) load into
one process under their own cache keys; each builds its own FusedDecoder over the same loaded
weights (decoder_from_weights: its own 8-row copies) and KV cache. A round times `--steps`
consecutive batch-1 steps (positions 0..steps-1) of A and of B, in alternating order. Unlike
gguf_kernel_ab.py (random tiles, one matrix shape at a time), this is the whole step at the model's
own shapes, threads and activations; unlike checkout_ab.py it leaves out the engine around it (the LM
head, sampling, scheduling), so a kernel change shows undiluted.

The decoder built second runs slower in this VM, by up to ~13 % on the 1.5B with identical sources
(an A/A run: B/A 1.13, 0 of 7 rounds faster; its ~1.1 GB of 8-row copies land in other memory). So
`--both-orders` runs the comparison twice, in fresh processes, building A first and then B first:
with r1, r2 the two B/A time ratios, the version ratio is sqrt(r1 r2) and the second-built penalty
sqrt(r1 / r2); both are reported. Read a single-order run only against an A/A run of the same model.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/quant/fused_step_ab.py MODEL.gguf \\
        /tmp/base/tokenloom/model/csrc tokenloom/model/csrc [--march native] [--rounds 11] [--both-orders] \\
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tokenloom
from tokenloom.model.execution_plan import with_engine_prefetch  # noqa: E402
from tokenloom.model.fused_decode import decoder_from_weights  # noqa: E402
from tokenloom.model.gguf_weights import load_gguf_quantized  # noqa: E402
from tokenloom.model.kernels import LDFLAGS, load_cached_extension  # noqa: E402
from tokenloom.model.rotary import rope_inv_freq  # noqa: E402


def build(name: str, csrc: Path, march: str) -> object:
    """One version's extension: its gguf_kernels.cpp and fused_decode.cpp (headers from csrc)."""
    sources = [csrc / "gguf_kernels.cpp", csrc / "fused_decode.cpp"]
    module = load_cached_extension(f"gguf_step_ab_{name}", sources, ["-O3", f"-march={march}", "-fopenmp"], LDFLAGS,
                                   f"GGUF kernels {name}")[0]
    return with_engine_prefetch(module)


def decoder_with_cache(module: object, config: object, weights: dict) -> tuple[object, torch.Tensor]:
    """A FusedDecoder of `module` over the loaded weights (its own 8-row copies) and its KV tensors, 16 blocks of
    16 slots a layer (the caller keeps the tensor alive as long as the decoder)."""
    decoder = decoder_from_weights(module, config, weights)
    layers, hkv, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    kv = torch.zeros(layers, 2, hkv, 16, 16, d)
    decoder.set_kv_caches([kv[i, 0] for i in range(layers)], [kv[i, 1] for i in range(layers)])
    return decoder, kv


def rope_tables(config: object) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..255 (step_ms's positions)."""
    freqs = torch.outer(torch.arange(256).float(), rope_inv_freq(config))
    return freqs.cos(), freqs.sin()


def step_ms(dec: object, steps: int, cos: torch.Tensor, sin: torch.Tensor, hidden: int) -> float:
    """Mean ms of `steps` batch-1 steps at positions 0..steps-1 (block table 0..15 of 16 slots each)."""
    table = torch.arange(16, dtype=torch.int32)[None]
    out = torch.empty(1, hidden)
    t0 = time.perf_counter()
    for pos in range(steps):
        dec.step(out, torch.tensor([100 + pos]), torch.tensor([pos]), torch.tensor([pos]), table, cos, sin)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf file")
    ap.add_argument("a", type=Path, help="csrc directory of version A (e.g. main's)")
    ap.add_argument("b", type=Path, help="csrc directory of version B")
    ap.add_argument("--march", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=64, help="steps per round (at most 256)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--build-first", choices=["A", "B"], default="A", help="which decoder is built (allocated) first")
    ap.add_argument("--both-orders", action="store_true", help="run with A built first, then B first, and combine")
    a = ap.parse_args()
    if a.both_orders:
        return both_orders(a)
    torch.set_num_threads(a.threads)
    load_start = os.getloadavg()
    order = ("A", "B") if a.build_first == "A" else ("B", "A")
    mods = {name: build(name, a.a if name == "A" else a.b, a.march) for name in order}
    config, weights = load_gguf_quantized(a.model)
    decs, caches = {}, {}  # caches: each decoder's KV tensors, alive as long as it is
    for name, mod in mods.items():
        decs[name], caches[name] = decoder_with_cache(mod, config, weights)
    cos, sin = rope_tables(config)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(a.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            times[name].append(step_ms(decs[name], a.steps, cos, sin, config.hidden_size))
    ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
    result = {"model": Path(a.model).name, "march": a.march, "threads": a.threads, "rounds": a.rounds,
              "build_first": a.build_first,
              "steps": a.steps, "a": str(a.a), "b": str(a.b),
              "a_step_ms": [round(t, 3) for t in times["A"]], "b_step_ms": [round(t, 3) for t in times["B"]],
              "a_median_ms": round(ma, 3), "b_median_ms": round(mb, 3), "b_over_a_time": round(mb / ma, 4),
              "rounds_b_faster": sum(tb < ta for ta, tb in zip(times["A"], times["B"])),
              "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_step_ms")}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


def both_orders(a: argparse.Namespace) -> None:
    """The comparison with A built first and with B built first (fresh processes), combined."""
    runs = []
    for first in ("A", "B"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            cmd = [sys.executable, __file__, a.model, str(a.a), str(a.b), "--march", a.march, "--threads",
                   str(a.threads), "--rounds", str(a.rounds), "--steps", str(a.steps), "--build-first", first,
                   "--json", str(out)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            runs.append(json.loads(out.read_text()))
    r1, r2 = runs[0]["b_over_a_time"], runs[1]["b_over_a_time"]
    result = {"model": runs[0]["model"], "march": a.march, "threads": a.threads, "rounds": a.rounds,
              "steps": a.steps, "a": str(a.a), "b": str(a.b),
              "b_over_a_time": round(math.sqrt(r1 * r2), 4), "second_built_penalty": round(math.sqrt(r1 / r2), 4),
              "b_over_a_a_built_first": r1, "b_over_a_b_built_first": r2, "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
