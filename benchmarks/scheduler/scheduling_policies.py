"""Figures for the opt-in scheduling policies (docs/scheduling_policies.md), on the simulator.

The real scheduler runs over the shipped cost-model profile on a virtual clock, so each figure is
deterministic and takes seconds; the vLLM-identical default is the first row of every table.

    .venv/bin/python benchmarks/scheduler/scheduling_policies.py --out docs/figures/scheduling_policies.json

1. Starvation: a steady load of decodes that leaves little of the budget, long prompts arriving
   now and then: the long prompts' TTFT (p50/p99) and the decodes' ITL p99, default vs bounded wait.
2. Priority preemption: a full batch of long low-priority requests (max_num_seqs reached), short
   high-priority requests arriving: their TTFT with and without --enable-priority-preemption.
3. SLO budget (--target-itl-ms / --target-ttft-ms): mixed chat + long documents at a stable and an
   overloading rate; fixed budgets vs the controller: ITL p99, TTFT p50/p99 and the share of requests
   meeting the targets. Only this part: --only slo.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenloom.config import CacheConfig, SchedulerConfig  # noqa: E402
from tokenloom.core.cost_model import CostModel  # noqa: E402
from tokenloom.sim.profile import load_profile  # noqa: E402
from tokenloom.sim.simulate import simulate  # noqa: E402
from tokenloom.workload.datasets import BenchRequest  # noqa: E402
from tokenloom.workload.metrics import percentile  # noqa: E402

PROFILE = Path(__file__).resolve().parents[2] / "tokenloom/sim/profiles/smollm2-135m-instruct-cpu.json"
INT8_PROFILE = PROFILE.with_name("smollm2-135m-instruct-cpu-int8.json")


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 1) if values else None


def starvation_workload(seed: int, duration_s: float, decode_rate: float, long_every_s: float,
                        long_len: int, chat_prompt: int = 32, chat_output: tuple[int, int] = (100, 200),
                        long_output: int = 16) -> list[BenchRequest]:  # fmt: skip
    """Poisson arrivals of short-prompt, long-output chats (the decode load: `chat_prompt` tokens,
    output lengths in [lo, hi)) plus a long prompt (a document to summarise) every `long_every_s` seconds."""
    rng = np.random.default_rng(seed)
    reqs: list[BenchRequest] = []
    t = 0.0
    i = 0
    while t < duration_s:
        t += float(rng.exponential(1.0 / decode_rate))
        reqs.append(BenchRequest(f"chat{i}", [int(x) for x in rng.integers(100, 40000, chat_prompt)], chat_prompt,
                                 int(rng.integers(*chat_output)), True, t))
        i += 1
    for j, at in enumerate(np.arange(long_every_s / 2, duration_s, long_every_s)):
        reqs.append(BenchRequest(f"doc{j}", [int(x) for x in rng.integers(100, 40000, long_len)], long_len,
                                 long_output, True, float(at)))
    return sorted(reqs, key=lambda r: r.arrival_s)


def run_starvation(profile: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    reqs = starvation_workload(args.seed, args.duration, args.decode_rate, args.long_every, args.long_len)
    base = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs, max_model_len=8192)
    cache = CacheConfig(block_size=16, num_blocks=args.num_blocks)
    rows = []
    variants = [("default (vLLM)", {})] + [
        (f"bound {ms} ms, chunk {chunk}", {"max_prefill_wait_ms": ms, "min_prefill_chunk": chunk})
        for ms, chunk in args.bounds
    ]
    for name, knobs in variants:
        res = simulate(reqs, replace(base, **knobs), cache, profile.cost_model)
        rows.append(starvation_row(name, res.records))
    return rows


def starvation_row(name: str, records: list[Any]) -> dict[str, Any]:
    """The long prompts' ("doc*") TTFT and the decodes' ("chat*") ITL, from per-request records (a
    simulation's or the real engine's, pooled over repeats)."""
    docs = [r for r in records if r.id.startswith("doc") and r.success]
    chats = [r for r in records if r.id.startswith("chat") and r.success]
    itl = [x for r in chats for x in r.itl_s]
    return {
        "policy": name,
        "long_prompt_ttft_p50_ms": _pct([r.ttft_s for r in docs], 50),
        "long_prompt_ttft_p99_ms": _pct([r.ttft_s for r in docs], 99),
        "long_prompt_ttft_max_ms": _pct([r.ttft_s for r in docs], 100),
        "decode_itl_p50_ms": _pct(itl, 50),
        "decode_itl_p99_ms": _pct(itl, 99),
        "num_long": len(docs), "num_chats": len(chats),
    }


def slo_workload(seed: int, duration_s: float, rate: float, doc_share: float, doc_len: int,
                 chat_prompt: tuple[int, int] = (100, 600), chat_output: tuple[int, int] = (50, 250),
                 doc_output: int = 32) -> list[BenchRequest]:  # fmt: skip
    """W2-like chat traffic (prompts 100-600 tokens, 50-250 output tokens, Poisson arrivals at `rate`)
    where a `doc_share` of the requests are long documents (`doc_len` tokens, 32 output tokens); the
    lengths are parameters for the real engine's scaled-down version."""
    rng = np.random.default_rng(seed)
    reqs: list[BenchRequest] = []
    t, i = 0.0, 0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            break
        if rng.random() < doc_share:
            n, out, name = doc_len, doc_output, f"doc{i}"
        else:
            n, out, name = int(rng.integers(*chat_prompt)), int(rng.integers(*chat_output)), f"chat{i}"
        reqs.append(BenchRequest(name, [int(x) for x in rng.integers(100, 40000, n)], n, out, True, t))
        i += 1
    return reqs


def slo_row(name: str, res: Any, itl_target_s: float, ttft_target_s: float) -> dict[str, Any]:
    """A request meets the ITL target when every gap between its tokens is within it (the target is a
    per-token promise), the TTFT target when its first token is within it."""
    return slo_row_of(name, res.records, res.num_steps, itl_target_s, ttft_target_s)


def slo_row_of(name: str, records: list[Any], num_steps: int, itl_target_s: float,
               ttft_target_s: float) -> dict[str, Any]:  # fmt: skip
    """slo_row from per-request records (a simulation's or the real engine's, pooled over repeats)."""
    done = [r for r in records if r.success]
    itl = [x for r in done for x in r.itl_s]
    ttft = [r.ttft_s for r in done]
    meets_itl = [max(r.itl_s, default=0.0) <= itl_target_s for r in done]
    meets_tpot = [(r.tpot_s or 0.0) <= itl_target_s for r in done]
    meets_ttft = [r.ttft_s <= ttft_target_s for r in done]
    both = [a and b for a, b in zip(meets_itl, meets_ttft)]
    docs = [r.ttft_s for r in done if r.id.startswith("doc")]

    def share(flags: list[bool]) -> float:
        return round(100.0 * sum(flags) / len(flags), 1) if flags else 0.0

    return {"policy": name, "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "doc_ttft_p50_ms": _pct(docs, 50),
            "meets_itl_pct": share(meets_itl), "meets_ttft_pct": share(meets_ttft), "meets_both_pct": share(both),
            "meets_tpot_and_ttft_pct": share([a and b for a, b in zip(meets_tpot, meets_ttft)]),
            "num_steps": num_steps, "num_requests": len(done)}


def run_slo(profile: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    itl_ms, ttft_ms = args.target_itl_ms, args.target_ttft_ms
    cache = CacheConfig(block_size=16, num_blocks=args.num_blocks)
    out = []
    for rate in args.slo_rates:
        reqs = slo_workload(args.seed, args.duration, rate, args.doc_share, args.doc_len)
        base = SchedulerConfig(max_num_batched_tokens=args.slo_ceiling, max_num_seqs=args.slo_max_num_seqs,
                               max_model_len=8192)
        variants: list[tuple[str, dict[str, Any]]] = [
            (f"fixed budget {b}" + (" (vLLM default)" if b == 2048 else ""), {"max_num_batched_tokens": b})
            for b in args.slo_budgets
        ]
        variants += [
            (f"controller: ITL {itl_ms:g} ms", {"target_itl_ms": itl_ms}),
            (f"controller: ITL {itl_ms:g} ms + TTFT {ttft_ms:g} ms",
             {"target_itl_ms": itl_ms, "target_ttft_ms": ttft_ms}),
        ]
        if args.wrong_profile:  # the controller predicting with another machine's / runner's profile
            variants.append((f"controller: ITL {itl_ms:g} ms, predicting with {Path(args.wrong_profile).name}",
                             {"target_itl_ms": itl_ms, "step_cost_profile": args.wrong_profile}))
        # The controller predicting with this profile mis-scaled (every step k times what it runs): it
        # corrects itself from the step times the engine core reports; with the predicted clock it
        # cannot (the profile alone), which shows what the correction is worth.
        scaled = CostModel({t: c * args.scaled_profile for t, c in profile.step_model.coefficients.items()})
        controllers = {}
        if args.scaled_profile > 0:
            for clock, how in (("predicted", ", uncorrected"), ("engine", "")):
                name = f"controller: ITL {itl_ms:g} ms, predicting with the profile x {args.scaled_profile:g}{how}"
                variants.append((name, {"target_itl_ms": itl_ms, "slo_clock": clock}))
                controllers[name] = scaled
        rows = []
        for name, knobs in variants:
            res = simulate(reqs, replace(base, **knobs), cache, profile.step_model,
                           controller_cost_model=controllers.get(name))
            rows.append(slo_row(name, res, itl_ms / 1000.0, ttft_ms / 1000.0))
        out.append({"rate": rate, "num_requests": len(reqs), "rows": rows})
    return out


def priority_workload(seed: int, num_bulk: int = 48, bulk_prompt: int = 256, bulk_output: int = 400,
                      bulk_every_s: float = 0.05, num_vip: int = 10, vip_prompt: int = 64, vip_output: int = 32,
                      vip_start_s: float = 5.0, vip_every_s: float = 3.0) -> list[BenchRequest]:  # fmt: skip
    """Long low-priority requests ("bulk*", priority 10) that fill the batch, then short high-priority
    ones ("vip*", priority 0) arriving while it is full."""
    rng = np.random.default_rng(seed)
    reqs = [BenchRequest(f"bulk{i}", [int(x) for x in rng.integers(100, 40000, bulk_prompt)], bulk_prompt,
                         bulk_output, True, float(i) * bulk_every_s, priority=10) for i in range(num_bulk)]
    reqs += [BenchRequest(f"vip{j}", [int(x) for x in rng.integers(100, 40000, vip_prompt)], vip_prompt,
                          vip_output, True, vip_start_s + vip_every_s * j, priority=0) for j in range(num_vip)]
    return sorted(reqs, key=lambda r: r.arrival_s)


def priority_row(name: str, records: list[Any], num_preemptions: int) -> dict[str, Any]:
    """High-priority ("vip*") TTFT and low-priority ("bulk*") E2E, from per-request records."""
    vip = [r.ttft_s for r in records if r.id.startswith("vip") and r.success]
    bulk = [r.e2e_s for r in records if r.id.startswith("bulk") and r.success]
    return {"policy": name, "high_priority_ttft_p50_ms": _pct(vip, 50), "high_priority_ttft_p99_ms": _pct(vip, 99),
            "low_priority_e2e_p50_ms": _pct(bulk, 50), "num_preemptions": num_preemptions}


def run_priority(profile: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    reqs = priority_workload(args.seed)
    base = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=8192, policy="priority")
    cache = CacheConfig(block_size=16, num_blocks=20000)
    rows = []
    for name, knobs in [("priority (vLLM)", {}),
                        ("priority + preemption for waiting", {"enable_priority_preemption": True})]:
        res = simulate(reqs, replace(base, **knobs), cache, profile.cost_model)
        rows.append(priority_row(name, res.records, res.num_preemptions))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(PROFILE))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals (virtual)")
    p.add_argument("--decode-rate", type=float, default=1.6, help="chat arrivals per second")
    p.add_argument("--long-every", type=float, default=10.0, help="seconds between long prompts")
    p.add_argument("--long-len", type=int, default=4000, help="tokens of each long prompt")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--num-blocks", type=int, default=40000)
    p.add_argument("--bounds", type=lambda s: [tuple(int(x) for x in b.split(":")) for b in s.split(",")],
                   default=[(1000, 64), (1000, 128), (2000, 256)], help="ms:chunk,ms:chunk,...")
    p.add_argument("--only", choices=["all", "slo"], default="all", help="slo: the SLO budget figure only")
    p.add_argument("--slo-rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0],
                   help="requests per second of the SLO workload (stable, overload)")
    p.add_argument("--doc-share", type=float, default=0.1, help="share of SLO requests that are long documents")
    p.add_argument("--doc-len", type=int, default=2000, help="tokens of each document in the SLO workload")
    p.add_argument("--slo-budgets", type=lambda s: [int(x) for x in s.split(",")],
                   default=[256, 512, 1024, 2048, 4096], help="fixed budgets to compare with the controller")
    p.add_argument("--slo-ceiling", type=int, default=2048, help="max_num_batched_tokens under the controller")
    p.add_argument("--slo-max-num-seqs", type=int, default=128, help="max_num_seqs of the SLO figure (vLLM's)")
    p.add_argument("--target-itl-ms", type=float, default=150.0)
    p.add_argument("--target-ttft-ms", type=float, default=2000.0)
    p.add_argument("--wrong-profile", default=str(INT8_PROFILE),
                   help="one more controller row, predicting with this profile while the simulation runs --profile "
                   "('' for none): how a wrong cost model shows")
    p.add_argument("--scaled-profile", type=float, default=0.6,
                   help="two more controller rows, predicting with the profile's step times times this (0: none): "
                   "without and with the correction by the simulated step times")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    profile = load_profile(args.profile)
    result: dict[str, Any] = {}
    if args.only == "all":
        result["starvation"] = run_starvation(profile, args)
        result["priority_preemption"] = run_priority(profile, args)
    result["slo_budget"] = run_slo(profile, args)
    result["args"] = {k: v for k, v in vars(args).items() if k != "bounds"} | {"bounds": args.bounds}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
