"""Where one runner step's time goes, op by op, and the GEMMs' achieved FLOP/s vs plain torch GEMMs.

Runs the real fused forward (`DecoderModel.forward` on the CPU kernel backend) with a timer around
every kernel and GEMM, on the scenarios of perf_step.py (a batch-128 decode at W1-like contexts,
a 2048-token prefill of W1-like prompts, a mixed step), then times the whole `execute_model` to
get the runner's own overhead (input preparation, sampling, bookkeeping) as the remainder.

    .venv/bin/python benchmarks/kernels/perf_breakdown.py [--dtype bfloat16] [--quantization int8] [--iters 5] \
        [--json out.json]

With --quantization int8 the GEMM rows time torch._int_mm on the int8 operands (GOP/s) and the
quantize / scale-back kernels appear under their own names.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from perf_step import Scenario, make_runner, split_budget  # noqa: E402


class _TimedKernels:
    """Proxy of the kernels module that times every call by kernel name."""

    NAMES = {"rms_norm": "embed+norm", "fused_add_rms_norm": "add+rmsnorm", "silu_and_mul": "silu*mul",
             "rotary_and_cache": "rotary+kv write", "paged_attention": "attention",
             "rms_norm_quant": "embed+norm+quant", "quantize_rows": "quantize attention output",
             "dequant": "dequant qkv (+ last down)", "dequant_add_rms_norm_quant": "dequant+add+rmsnorm+quant",
             "dequant_silu_mul_quant": "dequant+silu*mul+quant"}  # fmt: skip

    def __init__(self, module, timers: dict[str, float]) -> None:
        self._m, self._t = module, timers

    def __getattr__(self, name):
        fn = getattr(self._m, name)
        label = self.NAMES.get(name, name)

        def timed(*args):
            t0 = time.perf_counter()
            r = fn(*args)
            self._t[label] += time.perf_counter() - t0
            return r

        return timed


def timed_forward(runner, inputs, timers: dict[str, float], gemm_shapes: dict[str, tuple[int, int, int]]) -> None:
    """The real fused forward + logits, with the kernels and the linears timed (everything else,
    e.g. the embedding and the last layer's row selection, lands in the runner's remainder)."""
    from tokenloom.model import linear, quant

    m = runner.model
    names = {}
    for layer in m.layers:
        lins = layer.linears()
        names |= {id(lins["qkv_proj"]): "gemm qkv", id(lins["o_proj"]): "gemm o",
                  id(lins["gate_up_proj"]): "gemm gate_up", id(lins["down_proj"]): "gemm down"}  # fmt: skip
    names[id(m.lm_head)] = "gemm lm_head"
    calls: dict[str, list[int]] = collections.defaultdict(list)
    # Every GEMM goes through its linear method's apply_input (int8: the int32 GEMM alone; the
    # scale-back runs in the next kernel).
    originals = {cls: cls.apply_input for cls in (linear.UnquantizedLinearMethod, quant.Int8LinearMethod)}

    def timed(cls, suffix):
        original = originals[cls]

        def apply_input(method, lin, x):
            t0 = time.perf_counter()
            y = original(method, lin, x)
            label = names[id(lin)] + suffix
            timers[label] += time.perf_counter() - t0
            calls[label].append((x if isinstance(x, torch.Tensor) else x.q).shape[0])
            return y

        return apply_input

    # The kernels are held by the linear methods and the attention backend: time them all.
    holders = [m, m.attn_backend] + list({id(lin.quant_method): lin.quant_method for lin in m.linears()}.values())
    real_kernels = m.kernels
    proxy = _TimedKernels(real_kernels, timers)
    for holder in holders:
        holder.kernels = proxy
    linear.UnquantizedLinearMethod.apply_input = timed(linear.UnquantizedLinearMethod, "")
    quant.Int8LinearMethod.apply_input = timed(quant.Int8LinearMethod, " (int8)")
    try:
        hidden = m.forward(inputs.input_ids, inputs.positions, inputs.attn, runner.kv_caches, inputs.max_position)
        if hidden.shape[0] != len(inputs.sample_reqs):
            hidden = hidden.index_select(0, inputs.sample_indices)
        m.compute_logits(hidden, fp32=False)
    finally:
        for cls, original in originals.items():
            cls.apply_input = original
        for holder in holders:
            holder.kernels = real_kernels
    cfg = m.config
    hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    kn = {"gemm qkv": (hid, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d),
          "gemm o": (cfg.num_attention_heads * d, hid), "gemm gate_up": (hid, 2 * inter), "gemm down": (inter, hid),
          "gemm lm_head": (hid, m.vocab_size)}  # fmt: skip
    for label, ms in calls.items():
        gemm_shapes[label] = (ms, *kn[label.removesuffix(" (int8)")])


def plain_gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, min_time: float = 0.3) -> float:
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) * 0.05).to(dtype)
    y = torch.empty(m, n, dtype=dtype)
    torch.matmul(x, w.t(), out=y)
    iters, t0 = 0, time.perf_counter()
    while iters < 3 or time.perf_counter() - t0 < min_time:
        torch.matmul(x, w.t(), out=y)
        iters += 1
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF model dir (default: $TOKENLOOM_ANCHORS_DIR/smollm2-hf)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["int8"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--scenarios", default="decode,prefill,mixed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runner = make_runner(a.dtype, 8192, kernels=True, quantization=a.quantization, model=a.model)
    rng = np.random.default_rng(1)
    scn = Scenario(runner)
    report = {"dtype": a.dtype, "quantization": a.quantization, "threads": torch.get_num_threads(), "scenarios": {}}
    print(f"dtype {runner.dtype}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for name in a.scenarios.split(","):
        if name == "decode":
            runner.execute_model(scn.new_decodes(rng.integers(64, 513, a.batch).tolist(), extra_tokens=4 * a.iters + 8))
            ids = list(scn.live)[-a.batch :]
            make = lambda ids=ids: scn.continue_decodes(ids)  # noqa: E731
        elif name == "prefill":
            make = lambda: scn.prefills(split_budget(rng, 2048))  # noqa: E731
        else:
            runner.execute_model(scn.new_decodes(rng.integers(64, 513, a.batch // 2).tolist(),
                                                 extra_tokens=4 * a.iters + 8))  # fmt: skip
            ids = list(scn.live)[-(a.batch // 2) :]

            def make(ids=ids):
                so = scn.continue_decodes(ids)
                pf = scn.prefills(split_budget(rng, 2048 - len(ids)))
                so.scheduled_new_reqs = pf.scheduled_new_reqs
                so.num_scheduled_tokens.update(pf.num_scheduled_tokens)
                so.total_num_scheduled_tokens += pf.total_num_scheduled_tokens
                return so

        timers: dict[str, float] = collections.defaultdict(float)
        shapes: dict[str, tuple[int, int, int]] = {}
        steps = []
        for it in range(a.iters + 1):
            # Whole step through the real runner (also advances the decodes' state) ...
            so = make()
            t0 = time.perf_counter()
            runner.execute_model(so)
            if it:
                steps.append(time.perf_counter() - t0)
            # ... then the same-shaped forward again, op by op (KV writes land in the same slots).
            # The runner checks a step starts where its last one ended: rewind the states to the step's start.
            starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
            starts.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
            for rid, start in starts.items():
                runner.requests[rid].num_computed = start
            failed: dict[str, str] = {}
            sched = runner._collect_scheduled(so, failed)
            assert not failed, f"the op-by-op replay of the step was refused: {failed}"
            for s in sched:
                s.state.token_ids.pop()  # the token the real step appended
            prep0 = time.perf_counter()
            inputs = runner._prepare_inputs(sched)
            if it:
                timers["runner: prepare inputs"] += time.perf_counter() - prep0
            t_fw = collections.defaultdict(float)
            with torch.inference_mode():
                timed_forward(runner, inputs, t_fw, shapes)
            for s in sched:
                s.state.token_ids.append(0)
            if it:
                for key, v in t_fw.items():
                    timers[key] += v
        n = a.iters
        step = statistics.median(steps)
        per = {key: v / n for key, v in timers.items()}
        per["runner: other (sampling, states, outputs)"] = max(0.0, step - sum(per.values()))
        tokens = so.total_num_scheduled_tokens
        print(f"\n== {name}: {tokens} tokens, step median {step * 1e3:.1f} ms (load {os.getloadavg()[0]:.2f})")
        rows = []
        for key, v in sorted(per.items(), key=lambda kv: -kv[1]):
            row = {"op": key, "ms": round(v * 1e3, 2), "share": round(v / step, 3)}
            if key in shapes:
                ms, kk, nn = shapes[key]
                flops = sum(2 * mm * kk * nn for mm in ms)
                plain = sum(plain_gemm_seconds(mm, kk, nn, runner.dtype, 0.1) * c
                            for mm, c in collections.Counter(ms).items())
                row |= {"gflops": round(flops / v / 1e9, 1), "plain_torch_gflops": round(flops / plain / 1e9, 1)}
            rows.append(row)
            extra = (f"  {row['gflops']:6.1f} GF/s (plain torch GEMM {row['plain_torch_gflops']:6.1f})"
                     if "gflops" in row else "")
            print(f"  {key:42s} {row['ms']:8.2f} ms  {100 * row['share']:5.1f}%{extra}")
        report["scenarios"][name] = {"tokens": tokens, "step_ms": round(step * 1e3, 2), "ops": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
