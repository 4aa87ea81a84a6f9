"""Time and profile single runner steps of SmolLM2-135M: a decode step, a prefill step, a mixed step.

The KV cache is filled with random values instead of running real prefills (the timing of a decode
step does not depend on what the cache holds), so a batch-128 decode at context ~300 is ready at once.

    .venv/bin/python benchmarks/kernels/perf_step.py                      # wall-time medians, all scenarios
    .venv/bin/python benchmarks/kernels/perf_step.py --profile decode     # + torch.profiler op table
    .venv/bin/python benchmarks/kernels/perf_step.py --kernels off        # the pure-torch path

Scenarios (W1-like: contexts / prompts drawn uniformly from 64..512):
  decode   B decodes (default 128) at contexts 64..512 (+ --ctx-offset)
  prefill  fresh prompts summing to --prefill-tokens (default 2048)
  mixed    B/2 decodes + fresh prompts filling the rest of a 2048-token budget
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from tokenloom.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.sampling_params import SamplingParams


def default_model() -> str:
    """The anchors' HF copy of SmolLM2-135M-Instruct ($TOKENLOOM_ANCHORS_DIR/smollm2-hf)."""
    from tokenloom import envs

    return str(envs.TOKENLOOM_ANCHORS_DIR / "smollm2-hf")
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class Scenario:
    """Hands out block ids and builds SchedulerOutputs for one runner."""

    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.rng = np.random.default_rng(seed)
        self.next_block = 0
        self.next_id = 0
        self.live: dict[str, tuple[int, list[int]]] = {}  # req_id -> (num_computed, blocks)

    def _blocks(self, n_tokens: int) -> list[int]:
        bs = self.runner.block_size
        n = -(-n_tokens // bs)
        if self.next_block + n > self.runner.num_blocks:
            self.next_block = 0
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def new_decodes(self, contexts: list[int], extra_tokens: int = 64) -> SchedulerOutput:
        """Requests whose first ctx-1 tokens are 'cached' (random KV): one decode token each."""
        new, sched = [], {}
        for ctx in contexts:
            rid = f"r{self.next_id}"
            self.next_id += 1
            tokens = self.rng.integers(17, 49000, ctx).tolist()
            blocks = self._blocks(ctx + extra_tokens)
            new.append(NewRequestData(rid, tokens, tokens, GREEDY, (blocks,), ctx - 1))
            sched[rid] = 1
            self.live[rid] = (ctx - 1, blocks)
        return _so(new, CachedRequestData(), sched, set())

    def continue_decodes(self, req_ids: list[str]) -> SchedulerOutput:
        cached = CachedRequestData()
        sched = {}
        for rid in req_ids:
            done, blocks = self.live[rid]
            done += 1
            self.live[rid] = (done, blocks)
            cached.req_ids.append(rid)
            cached.new_block_ids.append(([],))
            cached.num_computed_tokens.append(done)
            sched[rid] = 1
        return _so([], cached, sched, set())

    def prefills(self, lengths: list[int], finished: set[str] = frozenset()) -> SchedulerOutput:
        new, sched = [], {}
        for n in lengths:
            rid = f"p{self.next_id}"
            self.next_id += 1
            tokens = self.rng.integers(17, 49000, n).tolist()
            new.append(NewRequestData(rid, tokens, tokens, GREEDY, (self._blocks(n + 1),), 0))
            sched[rid] = n
        return _so(new, CachedRequestData(), sched, set(finished))


def _so(new, cached, sched, finished) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched.values()), finished_req_ids=finished,
    )


def split_budget(rng: np.random.Generator, budget: int, lo: int = 64, hi: int = 512) -> list[int]:
    out = []
    while budget > 0:
        n = min(int(rng.integers(lo, hi + 1)), budget)
        out.append(n)
        budget -= n
    return out


def make_runner(dtype: str, num_blocks: int, block_size: int = 16, kernels: bool | None = None,
                quantization: str | None = None, model: str | None = None):
    from tokenloom.model.loader import load_model
    from tokenloom.model.platform import resolve_dtype
    from tokenloom.model.runner import ModelRunner

    dt = resolve_dtype(dtype, torch.device("cpu"))
    runner = ModelRunner(load_model(model or default_model(), dt), block_size=block_size, num_blocks=num_blocks,
                         dtype=dt, device="cpu",
                         cpu_kernels=kernels, quantization=quantization)
    with torch.no_grad():
        for k, v in runner.kv_caches:  # random KV: realistic values for the softmax
            k.normal_()
            v.normal_()
    return runner


def time_steps(runner, make_so, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        so = make_so()
        t0 = time.perf_counter()
        runner.execute_model(so)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF model dir (default: $TOKENLOOM_ANCHORS_DIR/smollm2-hf)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ctx-offset", type=int, default=0, help="added to every decode context")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--scenarios", default="decode,prefill,mixed")
    ap.add_argument("--kernels", default="auto", choices=["auto", "on", "off"], help="compiled CPU kernels")
    ap.add_argument("--profile", default=None, help="scenario to run under torch.profiler")
    ap.add_argument("--num-blocks", type=int, default=8192)
    a = ap.parse_args()

    runner = make_runner(a.dtype, a.num_blocks, kernels={"auto": None, "on": True, "off": False}[a.kernels],
                         model=a.model)
    rng = np.random.default_rng(1)
    print(f"dtype {runner.dtype}, threads {torch.get_num_threads()}, kernels {runner.use_kernels}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    scn = Scenario(runner)
    results = {}
    for name in a.scenarios.split(","):
        if name == "decode":
            ctx = (rng.integers(64, 513, a.batch) + a.ctx_offset).tolist()
            runner.execute_model(scn.new_decodes(ctx, extra_tokens=a.iters * 2 + 8))
            ids = list(scn.live)[-a.batch:]
            make = lambda ids=ids: scn.continue_decodes(ids)  # noqa: E731
        elif name == "prefill":
            make = lambda: scn.prefills(split_budget(rng, a.prefill_tokens))  # noqa: E731
        elif name == "mixed":
            ctx = (rng.integers(64, 513, a.batch // 2) + a.ctx_offset).tolist()
            runner.execute_model(scn.new_decodes(ctx, extra_tokens=a.iters * 2 + 8))
            ids = list(scn.live)[-(a.batch // 2):]

            def make(ids=ids):
                so = scn.continue_decodes(ids)
                pf = scn.prefills(split_budget(rng, a.prefill_tokens - len(ids)))
                so.scheduled_new_reqs = pf.scheduled_new_reqs
                so.num_scheduled_tokens.update(pf.num_scheduled_tokens)
                so.total_num_scheduled_tokens += pf.total_num_scheduled_tokens
                return so
        else:
            raise SystemExit(f"unknown scenario {name}")
        time_steps(runner, make, 2)  # warm-up
        if a.profile == name:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                times = time_steps(runner, make, 3)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        times = time_steps(runner, make, a.iters)
        med = statistics.median(times)
        results[name] = med
        print(f"{name:8s} median {med * 1e3:8.1f} ms  min {min(times) * 1e3:8.1f} ms  "
              f"({a.iters} steps, load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
