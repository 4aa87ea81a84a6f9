"""Two sources of gguf_kernels.cpp, A and B, on the same 8-row tiles of each GGML type: GEMV bytes/s, alternated.

Both builds load into one process (each under its own cache key), the weights are random blocks
(float16 scales small normal numbers) repacked once, and each round times, in alternating order, one
pass of A and of B over every matrix of a type, then torch's sum over the same bytes (a plain read).
The matrices are decode-shaped (Q4_K 8960 x 1536, `ffn_up`-like; Q6_K 1536 x 8960, `ffn_down`-like;
the 32-element types 4864 x 896, the 0.5B's MLP) and there are enough of them (~300 MB per K-quant,
~500 MB per 32-element type) to stream from DRAM, not from a large L3. `--rows` > 1 is the few-row
case of speculative verification; `--json` writes the per-type figures.

    mkdir -p /tmp/main_src && git archive main tokenloom/model/csrc | tar -x -C /tmp/main_src
    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/quant/gguf_kernel_ab.py \\
        /tmp/main_src/tokenloom/model/csrc/gguf_kernels.cpp tokenloom/model/csrc/gguf_kernels.cpp \\
        [--threads 1] [--rounds 21] [--rows 1] [--march haswell] [--types Q4_K,Q6_K,Q8_0,Q5_0,Q4_1] [--json OUT.json]

A version is built as the extension is: with the fused_decode.cpp beside it (when there is one; older
versions held the decoder in gguf_kernels.cpp) and the headers of its own directory, so pass a copy of
the whole csrc directory, not the one file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tokenloom
from tokenloom.model.execution_plan import with_engine_prefetch  # noqa: E402
from tokenloom.model.kernels import LDFLAGS, load_cached_extension  # noqa: E402

# type: (float16 field offsets, block bytes, block elements, matrix shape, matrices). The K-quants
# by default (the 1.5B's layers); the 32-element types are the 0.5B's (Q5_0 / Q8_0) and SmolLM2's (Q4_1).
TYPES = {
    Q.Q4_K: ([0, 2], 144, 256, (8960, 1536), 40),
    Q.Q6_K: ([208], 210, 256, (1536, 8960), 30),
    Q.Q8_0: ([0], 34, 32, (4864, 896), 110),
    Q.Q5_0: ([0], 22, 32, (4864, 896), 170),
    Q.Q4_1: ([0, 2], 20, 32, (4864, 896), 190),
}


def random_blocks(rng: np.random.Generator, f16: list[int], block_bytes: int, block_elems: int, n: int,
                  k: int) -> torch.Tensor:
    nb = k // block_elems
    raw = rng.integers(0, 256, size=(n, nb, block_bytes), dtype=np.uint8)
    for off in f16:
        scale = (rng.standard_normal((n, nb)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n, nb, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def extension_sources(gguf_kernels_cpp: Path) -> list[Path]:
    """The sources one version's extension links: gguf_kernels.cpp, and fused_decode.cpp beside it
    where the version has one (its module registers the decoder defined there)."""
    fused = gguf_kernels_cpp.parent / "fused_decode.cpp"
    return [gguf_kernels_cpp, fused] if fused.is_file() else [gguf_kernels_cpp]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="gguf_kernels.cpp, version A (e.g. main's)")
    ap.add_argument("b", type=Path, help="gguf_kernels.cpp, version B")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--rows", type=int, default=1, help="activation rows (1: single-stream decode)")
    ap.add_argument("--types", default="Q4_K,Q6_K", help="GGML types to time, comma-separated (of "
                    + ", ".join(t.name for t in TYPES) + ")")
    ap.add_argument("--march", default="native",
                    help="the builds' -march (haswell: the AVX2 path without VNNI on a VNNI machine)")
    ap.add_argument("--json", type=Path, help="also write the per-type figures here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    flags = ["-O3", f"-march={a.march}", "-fopenmp"]
    mods = {name: with_engine_prefetch(load_cached_extension(f"gguf_ab_{name}", extension_sources(src), flags, LDFLAGS,
                                                             f"GGUF kernels {name}")[0])
            for name, src in (("A", a.a), ("B", a.b))}
    rng = np.random.default_rng(0)
    types = [Q[name.strip()] for name in a.types.split(",")]
    sets = {}
    for qt in types:
        f16, bb, be, (n, k), count = TYPES[qt]
        sets[qt] = [mods["B"].gguf_repack8(random_blocks(rng, f16, bb, be, n, k), int(qt), k) for _ in range(count)]
        print(f"{qt.name}: {count} x [{n}, {k}], {sum(w.numel() for w in sets[qt]) / 1e6:.0f} MB", flush=True)
    rates: dict[tuple[str, Q], list[float]] = {(m, qt): [] for m in ("A", "B", "sum") for qt in types}
    for r in range(a.rounds):
        order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
        for qt, ws in sets.items():
            n, k = TYPES[qt][3]
            x, out = torch.randn(a.rows, k), torch.empty(a.rows, n)
            nbytes = sum(w.numel() for w in ws)
            for name in [*order, "sum"]:
                t0 = time.perf_counter()
                for w in ws:
                    if name == "sum":
                        w.view(torch.int64).sum()
                    else:
                        mods[name].gguf_linear_packed(out, x, w, int(qt), None)
                rates[(name, qt)].append(nbytes / (time.perf_counter() - t0) / 1e9)
    # On a loaded machine a round's two passes see different interference: the median of the per-round
    # ratios, and each version's best round (what it does when nothing interferes), are what to read.
    report = {"a": str(a.a), "b": str(a.b), "march": a.march, "threads": a.threads, "rows": a.rows,
              "rounds": a.rounds, "types": {}}
    for qt in types:
        ratios = [b / x for b, x in zip(rates[("B", qt)], rates[("A", qt)])]
        best = {m: max(rates[(m, qt)]) for m in ("A", "B", "sum")}
        med = {m: statistics.median(rates[(m, qt)]) for m in ("A", "B", "sum")}
        report["types"][qt.name] = {"b_over_a_median": round(statistics.median(ratios), 4),
                                    "rounds_b_faster": sum(r > 1 for r in ratios),
                                    "median_gb_s": {m: round(v, 2) for m, v in med.items()},
                                    "best_gb_s": {m: round(v, 2) for m, v in best.items()}}
        print(f"{qt.name} rows={a.rows} threads={a.threads}: B/A median of rounds {statistics.median(ratios):.3f} "
              f"({sum(r > 1 for r in ratios)} of {len(ratios)} rounds faster); best round A {best['A']:.1f}, "
              f"B {best['B']:.1f}, sum {best['sum']:.1f} GB/s (A {best['A'] / best['sum']:.0%}, B "
              f"{best['B'] / best['sum']:.0%} of a plain read); medians A {med['A']:.1f}, B {med['B']:.1f}, "
              f"sum {med['sum']:.1f} GB/s")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")

if __name__ == "__main__":
    main()
