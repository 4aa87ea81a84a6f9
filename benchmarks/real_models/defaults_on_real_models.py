"""The defaults on real models, side by side with llama.cpp: one table for docs/performance.md.

For each model (the shipped SmolLM2-135M Q4_1 and the two Qwen2.5-Coder GGUFs of `make bench-models`)
this runs `single_stream.py` with the engine's defaults and llama.cpp's `llama-bench` alternated in
one process per model (single-stream decode tok/s vs `tg`; a 512-token prompt's TTFT as prefill tok/s
vs `pp512`; weights in memory and RSS after start-up), then, unless --no-dequantized, the same with
`--quantization none` (the dequantizing path, the default before) without llama.cpp. One model at a
time, nothing in parallel: run it on a quiet machine.

    .venv/bin/python benchmarks/real_models/defaults_on_real_models.py \\
        --llama-bench ~/.cache/tokenloom-anchors/llamacpp-build/bin/llama-bench \\
        [--models smollm2,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b] [--rounds 3] [--bandwidth-probe] \\
        [--json docs/figures/defaults_real_models.json]

`--bandwidth-probe` passes single_stream.py's: each round tagged with the read bandwidth around it, and the
decode ratio per phase of a cloud VM's memory beside the table's (docs/performance.md, "The VM's two phases").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from real_models import MODELS, model_path  # noqa: E402


def model_file(name: str) -> str:
    if name == "smollm2":
        from tokenloom.model.loader import default_model_path

        return str(default_model_path())
    path = model_path(name)
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run `make bench-models` first")
    return str(path)


def single_stream(model: str, rounds: int, quantization: str, llama_bench: str | None, out_json: Path,
                  llama_args: tuple[str, ...] = (), bandwidth_probe: bool = False) -> dict:
    cmd = [sys.executable, str(HERE / "single_stream.py"), model, "--rounds", str(rounds), "--quantization",
           quantization, "--ttft-prompt-len", "512", "--output-len", "128", "--json", str(out_json)]
    if bandwidth_probe:
        cmd.append("--bandwidth-probe")
    if llama_bench:
        cmd += ["--llama-bench", llama_bench, *(f"--llama-arg={x}" for x in llama_args)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out_json.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2," + ",".join(MODELS))
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="extra llama-bench argument, repeatable (--llama-arg=--repack --llama-arg=0 on an AMX Xeon)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-dequantized", action="store_true", help="skip the --quantization none runs")
    ap.add_argument("--dequantized-models", default="smollm2,qwen2.5-coder-0.5b",
                    help="models to run dequantized too (the 1.5B in float32 needs ~6 GiB and minutes)")
    ap.add_argument("--bandwidth-probe", action="store_true",
                    help="tag each round with the machine's read bandwidth; add the decode ratio per phase")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.gettempdir()) / "tokenloom_defaults"
    tmp.mkdir(exist_ok=True)
    rows = []
    for name in a.models.split(","):
        model = model_file(name)
        row = {"model": name, "default": single_stream(model, a.rounds, "default", a.llama_bench, tmp / f"{name}.json",
                                                         tuple(a.llama_arg), a.bandwidth_probe)}
        if not a.no_dequantized and name in a.dequantized_models.split(","):
            row["dequantized"] = single_stream(model, max(1, a.rounds - 1), "none", None, tmp / f"{name}-none.json")
        rows.append(row)
    print("\n| model | decode tok/s: default / `--quantization none` / llama.cpp tg128 | prefill tok/s (512): "
          "default / none / llama.cpp pp512 | weights MiB (file) | RSS after start MiB |")
    print("|---|---|---|---|---|")
    nan = float("nan")
    for r in rows:
        d, n = r["default"], r.get("dequantized", {})
        print(f"| {r['model']} | {d['tokenloom_tok_s']:.1f} / {n.get('tokenloom_tok_s', nan):.1f} / "
              f"{d.get('llamacpp_tok_s', nan):.1f} | {d['tokenloom_prefill_tok_s']:.0f} / "
              f"{n.get('tokenloom_prefill_tok_s', nan):.0f} / {d.get('llamacpp_prefill_tok_s', nan):.0f}"
              f" | {d['weights_mib']:.0f} ({d['file_mib']:.0f}) | {d['rss_after_start_mib']:.0f} |")
    for r in rows:  # per phase of the VM's memory, where the rounds were tagged and it had more than one
        for phase, f in r["default"].get("by_phase", {}).items():
            if phase != "one":
                print(f"{r['model']}, {phase} read bandwidth ({f['read_gbs']} GB/s, {f['rounds']} rounds): "
                      f"decode {f['tokenloom_tok_s']} vs {f['llamacpp_tok_s']} tok/s, {f['ratio']}x")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
