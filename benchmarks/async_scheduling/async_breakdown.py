"""Where an async step's time goes, sync vs async, single stream (docs/async.md).

Per step (medians): TPOT; the worker's execute interval; the model's forward (the compiled decode
step for gguf) inside it; how long the engine thread waited for the output; and how much of each
forward the engine thread spent running its own Python (not waiting), i.e. competing with the
kernel's two OpenMP threads for the 2 cores.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_scheduling/async_breakdown.py gguf auto 3
    PYTHONPATH=$PWD .venv/bin/python benchmarks/async_scheduling/async_breakdown.py none bfloat16 3
"""

import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tokenloom.config import SchedulerConfig
from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

quant = sys.argv[1] if len(sys.argv) > 1 else None  # "none": dequantized; unset: the engine's default
dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
trace = Path(tempfile.mkdtemp()) / "s.jsonl"
# Built for async: the model lives on its one model thread, and the sync runs step there too (one
# thread hop a step), so both modes have one OpenMP team (docs/async.md, "One thread owns the model").
llm = LLM(dtype=dtype, quantization=quant, trace_steps=str(trace), async_scheduling=True)
eng = llm.llm_engine
model = eng.engine_core.executor.runner.model
F = []
of = model.forward


def fwd(*a, **k):
    t0 = time.monotonic()
    r = of(*a, **k)
    F.append((t0, time.monotonic()))
    return r


model.forward = fwd
base = SchedulerConfig(max_model_len=eng.scheduler_config.max_model_len)
single = [{"prompt_token_ids": list(range(200, 232))}]


def run(mode):
    eng.reset_scheduler(replace(base, async_scheduling=mode))
    eng.tracer._file.flush()
    start = len(trace.read_text().splitlines())
    F.clear()
    out = llm.generate(single, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0), use_tqdm=False)[0]
    eng.engine_core.drain()
    eng.tracer._file.flush()
    recs = [json.loads(x) for x in trace.read_text().splitlines()[start:]][2:]
    m = out.metrics
    tpot = 1e3 * (m.last_token_time - m.first_token_time) / 63
    ex = statistics.median(r["t_exec_end"] - r["t_exec_start"] for r in recs)
    fw = statistics.median(b - a for a, b in F[2:])
    wait = statistics.median(r["t_update"] - r["t_wait"] for r in recs)
    # main-thread busy time inside each forward window: main busy = not between t_wait..t_update
    waits = [(r["t_wait"], r["t_update"]) for r in recs]
    busy_in_fwd = []
    for a, b in F[2:]:
        w = sum(max(0, min(b, y) - max(a, x)) for x, y in waits)
        busy_in_fwd.append((b - a) - w)
    return tpot, 1e3 * ex, 1e3 * fw, 1e3 * wait, 1e3 * statistics.median(busy_in_fwd)


for mode in (False, True):
    run(mode)
res = {False: [], True: []}
for r in range(rounds):
    for mode in ((False, True) if r % 2 == 0 else (True, False)):
        res[mode].append(run(mode))
for mode in (False, True):
    cols = list(zip(*res[mode]))
    tpot, ex, fw, wait, busy = (statistics.median(c) for c in cols)
    print(f"{'async' if mode else 'sync '} TPOT {tpot:.2f}  execute {ex:.2f}  forward {fw:.2f}  "
          f"engine-thread wait {wait:.2f}  engine-thread busy in forward {busy:.2f} (ms)")
eng.close()
