"""The fused decode step of a real GGUF under each weight-prefetch setting, in one process, alternated.

One build of the kernels, one decoder over the model's weights: each round times `--steps` batch-1 steps
under every setting of `--stages` (0: no software prefetch, 1: the L1 stage, 2: L2 then L1; the kernels'
`set_weight_prefetch_stages`), in alternating order, after reading 512 MiB to tag the round with the
machine's read bandwidth (a cloud VM's moves between phases: docs/performance.md, "The VM's two
phases"). Unlike fused_step_ab.py (two builds, two decoders) the settings share the same memory, so there is
no second-built penalty to cancel; the result gives the medians per phase as well as overall.

    flock /tmp/tokenloom-bench.lock .venv/bin/python benchmarks/quant/prefetch_stages_step.py MODEL.gguf \\
        [--stages 0,1,2] [--rounds 12] [--march native] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks and tokenloom
from benchmarks.quant.fused_step_ab import build, decoder_with_cache, rope_tables, step_ms  # noqa: E402
from benchmarks.real_models.single_stream import new_probe_buffer, phases, read_gbs  # noqa: E402
from tokenloom.model.gguf_weights import load_gguf_quantized  # noqa: E402

CSRC = Path(__file__).resolve().parents[2] / "tokenloom" / "model" / "csrc"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf file")
    ap.add_argument("--stages", default="0,1,2", help="the settings to alternate, comma-separated (0, 1, 2)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=64, help="steps per setting and round (at most 256)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--march", default="native", help="the build's -march (haswell: the AVX2 path)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    settings = [int(x) for x in a.stages.split(",")]
    torch.set_num_threads(a.threads)
    module = build(f"prefetch_{a.march}", CSRC, a.march)
    config, weights = load_gguf_quantized(a.model)
    decoder, _kv = decoder_with_cache(module, config, weights)  # _kv: alive as long as the decoder
    cos, sin = rope_tables(config)
    probe = new_probe_buffer()
    before = module.weight_prefetch_stages()
    probes: list[list[float]] = []
    times: dict[int, list[float]] = {s: [] for s in settings}
    try:
        for r in range(a.rounds):
            probes.append([read_gbs(probe)])
            for stages in settings if r % 2 == 0 else settings[::-1]:
                module.set_weight_prefetch_stages(stages)
                times[stages].append(step_ms(decoder, a.steps, cos, sin, config.hidden_size))
            probes[-1].append(read_gbs(probe))
            print(f"round {r}: " + ", ".join(f"{s} stages {times[s][-1]:.2f} ms" for s in settings)
                  + f" (read GB/s {probes[-1][0]:.1f} {probes[-1][1]:.1f})", flush=True)
    finally:
        module.set_weight_prefetch_stages(before)
    base = settings[0]
    phase_of = phases(probes)

    def summary(idx: list[int]) -> dict:
        return {"rounds": len(idx), "read_gbs": round(statistics.median(x for i in idx for x in probes[i]), 1),
                "step_ms": {s: round(statistics.median(times[s][i] for i in idx), 3) for s in settings},
                f"time_over_{base}_stages": {s: round(statistics.median(times[s][i] / times[base][i] for i in idx), 4)
                                             for s in settings[1:]}}

    result = {"model": Path(a.model).name, "march": a.march, "threads": a.threads, "steps": a.steps,
              "stages": settings, "step_ms_rounds": {s: [round(t, 3) for t in v] for s, v in times.items()},
              "read_gbs_rounds": [[round(x, 1) for x in p] for p in probes], "phase_rounds": phase_of,
              "all": summary(list(range(a.rounds))),
              "by_phase": {ph: summary(idx) for ph in ("low", "high", "one")
                           if (idx := [i for i, p in enumerate(phase_of) if p == ph])}}
    print(json.dumps({k: result[k] for k in ("model", "march", "all", "by_phase")}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
