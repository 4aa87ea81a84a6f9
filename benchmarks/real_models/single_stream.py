"""Single-stream decode and TTFT: tokenloom vs llama.cpp's `llama-bench` on the same GGUF, alternating.

One request at a time, greedy, ignore_eos: tokenloom's decode tok/s is 1000 / the median decode
step (the engine's whole step: schedule, inputs, forward, logits, sampling, outputs; see
perf_overhead.py), llama.cpp's is llama-bench's `tg` figure (`-n N`, `-t` threads). TTFT: tokenloom's
is the wall time of a fresh request with a `--ttft-prompt-len` random prompt and max_tokens=1
(add_request to finished: the prefill step, sampling, outputs); llama.cpp's is that prompt length
over llama-bench's `pp` rate for it (`-p P`). The two run in turns, `--rounds` times, so that a
shared machine's load hits both alike; medians reported.

    .venv/bin/python benchmarks/real_models/single_stream.py [MODEL.gguf] \\
        --llama-bench ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-bench [--rounds 3] [--json out.json]

`--cpu-isa avx2` runs tokenloom as on a CPU with only AVX2 (TOKENLOOM_CPU_ISA, tokenloom/cpu_isa.py): the
AVX2 proxy of an AMD EPYC on an AVX-512 Xeon, against llama.cpp built for AVX2 only
(benchmarks/real_models/setup_llamacpp_avx2.sh) with its defaults:

    flock /tmp/tokenloom-bench.lock env PYTHONPATH=$PWD .venv/bin/python benchmarks/real_models/single_stream.py \
        MODEL.gguf --cpu-isa avx2 --llama-bench ~/.cache/tokenloom-anchors/llamacpp-avx2/bin/llama-bench \
        --rounds 5 --json docs/figures/single_stream_<model>_avx2_proxy.json

Without --llama-bench only tokenloom runs. `--quantization` defaults to the engine's own default (a
quantized GGUF stays quantized); `--quantization none` is the dequantized float path. The result also
has the weights' bytes in memory and the process RSS after the engine is built (before any request).

`--bandwidth-probe` reads a 512 MiB buffer with torch's threads (`read_gbs`) right before and after each
side of each round: a cloud VM's DRAM bandwidth moves between phases of seconds to minutes (a 2-core
Zen 4 switched between ~55 and ~35 GB/s for every buffer of every process at once), and a model whose
step is bound by the bus moves with it. The result then has each round's four probes, each side's
share of the bandwidth it had (the weight bytes a decode step reads, from the GGUF's tensor table, times
tok/s, over the mean of its two probes), and, per phase ("low" / "high" read bandwidth, `phases`), the
medians over the rounds whose four probes all fell in it (`by_phase`). `--wait-for-gbs X` (with the probe)
starts each side only once a probe reads at least X GB/s (or after `--wait-max-s`): so that more rounds fall
wholly in the fast phase when it is the rarer one; both sides wait alike, and the probes still decide which
rounds count for which phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.* and tokenloom


def llama_bench(binary: str, model: str, threads: int, n: int, prompt_len: int,
                extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """(tg tok/s, TTFT ms for a prompt_len prompt) from one llama-bench run (`extra`: more llama-bench args)."""
    out = subprocess.run([binary, "-m", model, "-t", str(threads), "-p", str(prompt_len), "-n", str(n), "-r", "1",
                          "-o", "json", *extra], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    tg = [r for r in rows if r.get("n_gen", 0) > 0][0]
    pp = [r for r in rows if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0][0]
    return float(tg["avg_ts"]), 1e3 * prompt_len / float(pp["avg_ts"])


def ttft_ms(engine, prompt_len: int, seed: int) -> float:  # noqa: ANN001 - an LLMEngine
    """Wall time of one fresh request (random prompt, so no prefix-cache hit) with max_tokens=1."""
    from tokenloom.sampling_params import RequestOutputKind, SamplingParams

    rng = random.Random(10_000 + seed)
    prompt = [rng.randrange(17, engine.model_config.vocab_size) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    t0 = time.perf_counter()
    engine.add_request(f"ttft-{seed}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * (time.perf_counter() - t0)


def new_probe_buffer() -> torch.Tensor:
    """512 MiB of float32: far larger than any L3, so each read comes from DRAM."""
    import torch  # here, not at the top: torch must load after tokenloom has applied the ISA cap

    return torch.ones(128 * 2**20)


def read_gbs(buffer: torch.Tensor, reps: int = 3) -> float:
    """The machine's read bandwidth now, GB/s: the best of `reps` torch sums of `buffer` (larger than any cache)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t0)
    return buffer.numel() * buffer.element_size() / best / 1e9


def wait_for_bandwidth(probe: Callable[[], float], at_least: float, max_s: float,
                       clock: Callable[[], float] = time.monotonic) -> float:
    """Probe until a reading is at least `at_least` GB/s or `max_s` seconds have passed; the seconds waited."""
    start = clock()
    while probe() < at_least and clock() - start < max_s:
        pass
    return clock() - start


def decode_bytes_per_token(gguf_path: str) -> int:
    """Bytes of weights one decode step reads, from the GGUF's tensor table: every tensor, less the token
    embedding (one row a token) unless the file has no `output.weight` (tied: the LM head reads all of it).
    The same for both engines, which keep the blocks as stored (tokenloom in 8-row copies of equal size)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf_path).tensors}
    untied = "output.weight" in sizes
    return sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if untied else 0)


def phases(probes: list[list[float]], spread: float = 1.25) -> list[str]:
    """Per round, the machine's phase: "low" or "high" when all of its probes (both sides, before and after)
    fall on one side of the geometric mean of the lowest and highest probe of the run, else "mixed". A run
    whose probes all lie within `spread` of each other had one phase: every round is "one"."""
    flat = [x for p in probes for x in p]
    lo, hi = min(flat), max(flat)
    if hi <= spread * lo:
        return ["one"] * len(probes)
    cut = (lo * hi) ** 0.5
    return ["high" if min(p) > cut else "low" if max(p) < cut else "mixed" for p in probes]


def rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a .gguf file (default: the shipped SmolLM2 Q4_1)")
    ap.add_argument("--quantization", default="default", choices=["default", "gguf", "int8", "none"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="extra llama-bench argument, repeatable (e.g. --llama-arg=--repack --llama-arg=0 on an AMX "
                         "Xeon, where the shared build's repacked / AMX kernels die with SIGILL)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ttft-prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-isa", default=None, choices=["native", "avx2", "avx512", "avx512_vnni", "avx512_bf16"],
                    help="run tokenloom as on a CPU with only this ISA (TOKENLOOM_CPU_ISA; default: the variable, "
                         "else native)")
    ap.add_argument("--bandwidth-probe", action="store_true",
                    help="read 512 MiB before and after each side of each round; report the phase-matched ratio")
    ap.add_argument("--wait-for-gbs", type=float, default=None,
                    help="with --bandwidth-probe: start each side only once a probe reads this many GB/s")
    ap.add_argument("--wait-max-s", type=float, default=120.0, help="give up waiting for --wait-for-gbs after this")
    a = ap.parse_args()
    if a.wait_for_gbs is not None and not a.bandwidth_probe:
        ap.error("--wait-for-gbs needs --bandwidth-probe")
    if a.cpu_isa:  # before tokenloom (and through it torch) loads: torch reads its cap once
        os.environ["TOKENLOOM_CPU_ISA"] = a.cpu_isa
    import tokenloom  # noqa: F401 - first, so that it caps torch's kernels under TOKENLOOM_CPU_ISA
    from benchmarks.kernels.perf_overhead import run
    from tokenloom.cpu_isa import cap_name
    from tokenloom.engine.llm_engine import LLMEngine
    from tokenloom.model.loader import resolve_model_path

    model = str(resolve_model_path(a.model))
    quant = None if a.quantization == "default" else a.quantization
    load_start = os.getloadavg()
    engine = LLMEngine.from_args(model=model, dtype=a.dtype, quantization=quant)
    weights_mib = engine.runner.model.weight_bytes() / 2**20
    rss_mib = rss_now_mib()
    ttft_ms(engine, a.ttft_prompt_len, seed=-1)  # warm-up: first prefill builds the dequantized-GEMM path
    probe_buffer = new_probe_buffer() if a.bandwidth_probe else None
    probes: list[list[float]] = []  # per round: tokenloom before, after, then llama.cpp before, after
    ours, theirs, our_ttft, their_ttft = [], [], [], []
    waited_s: list[float] = []  # per side, in run order: the seconds spent waiting for --wait-for-gbs

    def wait_for_phase() -> None:
        if a.wait_for_gbs is not None:
            waited_s.append(round(wait_for_bandwidth(lambda: read_gbs(probe_buffer), a.wait_for_gbs,
                                                     a.wait_max_s), 1))

    for r in range(a.rounds):
        wait_for_phase()
        probe = [read_gbs(probe_buffer)] if a.bandwidth_probe else []
        res = run(engine, 1, a.prompt_len, a.output_len, seed=r)
        probe += [read_gbs(probe_buffer)] if a.bandwidth_probe else []
        ours.append(1000.0 / res["step_ms_median"])
        our_ttft.append(ttft_ms(engine, a.ttft_prompt_len, seed=r))
        line = (f"round {r}: tokenloom {ours[-1]:7.1f} tok/s, TTFT {our_ttft[-1]:6.1f} ms "
                f"(host work outside the model {res['overhead_ms_median']} ms)")
        if a.llama_bench:
            wait_for_phase()
            probe += [read_gbs(probe_buffer)] if a.bandwidth_probe else []
            tg, ttft = llama_bench(a.llama_bench, model, a.threads, a.output_len, a.ttft_prompt_len,
                                   tuple(a.llama_arg))
            probe += [read_gbs(probe_buffer)] if a.bandwidth_probe else []
            theirs.append(tg)
            their_ttft.append(ttft)
            line += f"; llama.cpp {tg:7.1f} tok/s, TTFT {ttft:6.1f} ms"
        if probe:
            probes.append(probe)
            line += " (read GB/s " + " ".join(f"{x:.1f}" for x in probe) + ")"
        print(line, flush=True)
    result = {"model": Path(model).name, "cpu_isa": cap_name(), "quantization": engine.config.quantization or "none",
              "dtype": str(engine.dtype).replace("torch.", ""), "tokenloom_tok_s": statistics.median(ours),
              "tokenloom_ttft_ms": statistics.median(our_ttft), "ttft_prompt_len": a.ttft_prompt_len,
              "tokenloom_prefill_tok_s": 1e3 * a.ttft_prompt_len / statistics.median(our_ttft),
              "weights_mib": round(weights_mib, 1), "rss_after_start_mib": round(rss_mib, 1),
              "file_mib": round(Path(model).stat().st_size / 2**20, 1), "rounds": a.rounds,
              "output_len": a.output_len, "threads": a.threads,
              "tokenloom_tok_s_rounds": [round(x, 2) for x in ours],
              # other processes' load: the 1/5/15-minute load averages before the engine started and at the end
              "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    if theirs:
        result["llamacpp_tok_s"] = statistics.median(theirs)
        result["llamacpp_tok_s_rounds"] = [round(x, 2) for x in theirs]
        result["llama_bench"] = a.llama_bench
        result["llama_args"] = a.llama_arg
        result["llamacpp_ttft_ms"] = statistics.median(their_ttft)
        result["ratio"] = result["tokenloom_tok_s"] / result["llamacpp_tok_s"]
        result["llamacpp_prefill_tok_s"] = 1e3 * a.ttft_prompt_len / result["llamacpp_ttft_ms"]
        result["prefill_ratio"] = result["tokenloom_prefill_tok_s"] / result["llamacpp_prefill_tok_s"]
    if probes:
        # Each side's share of the bus: the weight bytes a token reads times tok/s, over the read bandwidth
        # probed around it (a quantized GGUF only: a dequantized model reads other bytes).
        token_gb = decode_bytes_per_token(model) / 1e9 if model.endswith(".gguf") and quant != "none" else None
        result["read_gbs_rounds"] = [[round(x, 1) for x in p] for p in probes]
        result["decode_gb_per_token"] = token_gb and round(token_gb, 4)
        if waited_s:
            result["wait_for_gbs"] = a.wait_for_gbs
            result["waited_s_sides"] = waited_s
        if token_gb:
            result["tokenloom_bus_share_rounds"] = [round(token_gb * t / statistics.mean(p[:2]), 3)
                                                    for t, p in zip(ours, probes)]
        if theirs:
            if token_gb:
                result["llamacpp_bus_share_rounds"] = [round(token_gb * t / statistics.mean(p[2:]), 3)
                                                       for t, p in zip(theirs, probes)]
            result["ratio_rounds"] = [round(o / t, 3) for o, t in zip(ours, theirs)]
            result["phase_rounds"] = phase_of = phases(probes)
            # Per phase: the rounds wholly inside it, the median read GB/s, tok/s of each side and ratio.
            result["by_phase"] = {
                phase: {"rounds": len(idx),
                        "read_gbs": round(statistics.median(x for i in idx for x in probes[i]), 1),
                        "tokenloom_tok_s": round(statistics.median(ours[i] for i in idx), 2),
                        "llamacpp_tok_s": round(statistics.median(theirs[i] for i in idx), 2),
                        "ratio": round(statistics.median(ours[i] / theirs[i] for i in idx), 3)}
                for phase in ("low", "high", "one")
                if (idx := [i for i, ph in enumerate(phase_of) if ph == phase])}
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
