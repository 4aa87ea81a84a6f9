"""W1 side by side: tokenloom vs vLLM's CPU build, alternating, with a contamination check per run.

The machine's two cores are shared: each run waits for a quiet moment (1-minute load under
--max-load and no other process over 20% CPU), holds the anchors' bench lock, and records the CPU
time used by other processes while it ran (from /proc/stat minus its own children's rusage). A run
where others used more than --max-foreign of the machine is kept but flagged; medians are reported
over the clean runs (and over all runs).

    .venv/bin/python benchmarks/real_models/perf_w1.py --runs 3 --engines tokenloom,vllm --json /tmp/w1.json
    .venv/bin/python benchmarks/real_models/perf_w1.py --engines tokenloom,tokenloom-generate --dtype float32

Engines:
  tokenloom           `tokenloom bench throughput <model> --dataset-path W1 --modes continuous`
  tokenloom-int8      the same with `--quantization int8` (W8A8 layers, SmoothQuant-calibrated)
  tokenloom-generate  W1 through `LLM.generate` (token-id prompts, detokenized outputs)
  vllm                ../shared/anchors/vllm_offline.py in the anchors' vllm-venv
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tokenloom import envs  # noqa: E402

ANCHORS = envs.TOKENLOOM_ANCHORS_DIR  # $TOKENLOOM_ANCHORS_DIR (or $ANCHORS), else ~/.cache/tokenloom-anchors
W1 = ANCHORS / "workloads/w1_n128_s20251129.jsonl"
SHARED = envs.TOKENLOOM_ANCHORS_SCRIPTS  # vllm_offline.py; else shared/anchors beside the checkout

GENERATE_SCRIPT = r"""
import json, sys, time
from tokenloom import LLM, SamplingParams
model, dtype, workload, out = sys.argv[1:5]
reqs = [json.loads(l) for l in open(workload) if l.strip()]
llm = LLM(model, dtype=dtype)
llm.generate([{"prompt_token_ids": list(range(100, 164))}], SamplingParams(max_tokens=8, ignore_eos=True,
             temperature=0), use_tqdm=False)
prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0) for r in reqs]
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t0
n_out = sum(len(o.outputs[0].token_ids) for o in outs)
json.dump({"wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall}, open(out, "w"))
"""


def busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle, iowait


def others_busy(threshold: float = 20.0) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    me = {os.getpid(), os.getppid()}
    busy = []
    for line in out.splitlines()[1:6]:
        pid, pcpu, args = line.split(None, 2)
        if int(pid) not in me and float(pcpu) > threshold and not args.startswith("ps "):
            busy.append(f"{pcpu}% {args[:60]}")
    return busy


def wait_quiet(max_load: float, max_wait: float) -> float:
    t0 = time.time()
    while time.time() - t0 < max_wait:
        if os.getloadavg()[0] < max_load and not others_busy():
            return time.time() - t0
        time.sleep(10)
    return time.time() - t0


def command(engine: str, model: str, dtype: str, out: str) -> list[str]:
    if engine in ("tokenloom", "tokenloom-int8"):
        quant = ["--quantization", "int8"] if engine == "tokenloom-int8" else []
        return [str(REPO / ".venv/bin/tokenloom"), "bench", "throughput", model, "--dataset-path", str(W1),
                "--modes", "continuous", "--dtype", dtype, "--result-file", out, *quant]  # fmt: skip
    if engine == "tokenloom-generate":
        return [str(REPO / ".venv/bin/python"), "-c", GENERATE_SCRIPT, model, dtype, str(W1), out]
    if engine == "vllm":
        vmodel = str(ANCHORS / ("smollm2-hf" if dtype == "bfloat16" else "smollm2-hf-fp32"))
        return [envs.TOKENLOOM_VLLM_PYTHON, str(SHARED / "vllm_offline.py"), "--model", vmodel,
                "--dtype", dtype, "--workload", str(W1), "--out", out]  # fmt: skip
    raise ValueError(engine)


def parse(engine: str, out: str) -> dict:
    data = json.loads(Path(out).read_text())
    if engine in ("tokenloom", "tokenloom-int8"):
        m = data["median"]["continuous"]
        return {"wall_s": m["duration_s"], "output_tok_s": m["output_tok_s"]}
    if engine == "vllm":
        return {"wall_s": data["wall_s"], "output_tok_s": data["output_tok_s"], "init_s": data["init_s"]}
    return {"wall_s": data["wall_s"], "output_tok_s": data["output_tok_s"]}


def run_once(engine: str, model: str, dtype: str, max_load: float, lock: Path) -> dict:
    waited = wait_quiet(max_load, 900)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        cmd = command(engine, model, dtype, out)
        if lock.exists():
            cmd = ["flock", str(lock), *cmd]
        ru0, busy0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), busy_jiffies(), time.time()
        load0 = os.getloadavg()[0]
        proc = subprocess.run(cmd, cwd=tempfile.gettempdir(), capture_output=True, text=True)
        wall = time.time() - t0
        ru1, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), busy_jiffies()
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} failed:\n{proc.stderr[-3000:]}")
        own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        foreign = max(0.0, (busy1 - busy0) / os.sysconf("SC_CLK_TCK") - own)
        res = parse(engine, out)
    share = round(foreign / (wall * os.cpu_count()), 3)
    res |= {"engine": engine, "dtype": dtype, "process_wall_s": round(wall, 1), "waited_s": round(waited),
            "load_before": round(load0, 2), "foreign_cpu_share": share}  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="tokenloom,vllm")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="tokenloom's model (default: the anchors' HF dir of the dtype)")
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--max-foreign", type=float, default=0.03, help="flag runs where others used more")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    engines = a.engines.split(",")
    model = a.model or str(ANCHORS / ("smollm2-hf" if a.dtype == "bfloat16" else "smollm2-hf-fp32"))
    runs = []
    for i in range(a.runs):
        for engine in engines:  # alternate A, B, A, B, ...
            res = run_once(engine, model, a.dtype, a.max_load, ANCHORS / "bench.lock")
            res["clean"] = res["foreign_cpu_share"] <= a.max_foreign
            runs.append(res)
            flag = "" if res["clean"] else ": FLAGGED"
            print(f"[{i + 1}/{a.runs}] {engine:18s} {res['wall_s']:7.1f} s  {res['output_tok_s']:7.1f} out tok/s  "
                  f"(others used {100 * res['foreign_cpu_share']:.1f}% of the CPUs{flag})", flush=True)
    summary = {}
    for engine in engines:
        mine = [r for r in runs if r["engine"] == engine]
        clean = [r for r in mine if r["clean"]]
        summary[engine] = {
            "median_wall_s_all": statistics.median(r["wall_s"] for r in mine),
            "median_out_tok_s_all": statistics.median(r["output_tok_s"] for r in mine),
            "median_wall_s_clean": statistics.median(r["wall_s"] for r in clean) if clean else None,
            "median_out_tok_s_clean": statistics.median(r["output_tok_s"] for r in clean) if clean else None,
            "clean_runs": len(clean), "runs": len(mine),
        }  # fmt: skip
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
