"""Differential test: tokenloom's step replay against vLLM 0.32's real V1 scheduler, step by step.

    .venv/bin/python benchmarks/vllm_conformance/compare.py -n 300 --seed 0
    .venv/bin/python benchmarks/vllm_conformance/compare.py --cases      # re-run the saved cases against vLLM

Generates N random traces (seeded) that vary every knob of the trace config, replays each with
tokenloom in-process and with vLLM in a subprocess (vllm_replay.py under vLLM's venv, many traces per
process: importing vLLM takes seconds), diffs the STEPS step by step, prints the first differing step
of each mismatching trace with context, and a summary. Mismatching traces are saved under cases/
(with vLLM's STEPS as the expected output) for tests/test_vllm_conformance.py; --save-diverse also
saves a spread of matching traces, one per feature they exercise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES_DIR = HERE / "cases"
STEP_FIELDS = ("scheduled", "preempted", "finished", "num_free_blocks", "cached_tokens")

sys.path.insert(0, str(REPO))
from tokenloom import envs  # noqa: E402
from tokenloom.config import ConfigError  # noqa: E402
from tokenloom.core.replay import replay as tokenloom_replay  # noqa: E402


# Trace generation ---------------------------------------------------------------------------------
def random_trace(rng: random.Random) -> dict[str, Any]:
    """One random trace; every knob varies. Configs stay within vLLM's SchedulerConfig rules."""
    big = rng.random() < 0.12  # now and then, sizes closer to a real deployment
    block_size = rng.choice([16, 32]) if big else rng.choice([1, 2, 3, 4, 4, 5, 8, 16])
    max_model_len = rng.choice([512, 1024]) if big else rng.choice([2, 3, 8, 16, 24, 32, 48, 64, 100, 128, 256])
    chunked = rng.random() < 0.7
    max_num_seqs = rng.choice([1, 2, 3, 4, 6, 8, 16])
    if chunked:
        budget = rng.choice([128, 256, 512, 2048] if big else [1, 2, 4, 8, 12, 16, 32, 64, 128, 512])
    else:
        # vLLM: with chunked prefill off, max_num_batched_tokens >= max_model_len.
        budget = max_model_len + rng.choice([0, 0, 1, 8, 64, 200])
    budget = max(budget, max_num_seqs)  # vLLM: max_num_batched_tokens >= max_num_seqs
    threshold = 0 if rng.random() < 0.5 else rng.randint(1, max_model_len)  # vLLM: <= max_model_len
    # Pool: from starved (forces preemption) to roomy, in blocks of the chosen size.
    max_blocks_per_req = -(-max_model_len // block_size)
    num_blocks = max(1, int(max_blocks_per_req * rng.choice([0.3, 0.6, 1.0, 1.0, 1.5, 2.5, 4, 10])))
    config: dict[str, Any] = {
        "max_num_batched_tokens": budget,
        "max_num_seqs": max_num_seqs,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": threshold,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "policy": rng.choice(["fcfs", "priority"]),
        "enable_prefix_caching": rng.random() < 0.7,
        "max_model_len": max_model_len,
    }
    # tokenloom also reads vLLM's watermark and scheduler_reserve_full_isl; vary them now and then.
    if rng.random() < 0.15:
        config["watermark"] = rng.choice([0.01, 0.05, 0.1, 0.2])
    if rng.random() < 0.2:
        config["scheduler_reserve_full_isl"] = False

    # Prompts grow from a few shared stems, so prefix hits (and, with a small pool, evictions) happen.
    vocab = rng.choice([3, 10, 1000])
    stems = [[rng.randrange(vocab) for _ in range(max_model_len)] for _ in range(rng.randint(1, 3))]
    num_requests = rng.randint(1, rng.choice([6, 14, 30]))
    spread = rng.choice([0, 0, 3, 10, 30])
    requests = []
    for i in range(num_requests):
        roll = rng.random()
        if roll < 0.03:
            plen = 0
        elif roll < 0.08:
            plen = rng.randint(max_model_len - 1, max_model_len + 2)
        else:
            plen = rng.randint(1, max(1, int(max_model_len * rng.choice([0.25, 0.5, 0.9]))))
        if rng.random() < 0.6:
            stem = rng.choice(stems)
            shared = rng.randint(0, min(plen, len(stem)))
            prompt = stem[:shared] + [rng.randrange(vocab) for _ in range(plen - shared)]
        else:
            prompt = [rng.randrange(vocab) for _ in range(plen)]
        max_tokens = rng.choice([1, 1, 2, 3, 5, 8, 16, 40, 64 if big else max_model_len])
        rid = f"r{i}"
        if i and rng.random() < 0.03:
            rid = requests[rng.randrange(i)]["id"]  # a reused id: refused while the first one is alive
        requests.append(
            {
                "id": rid,
                "arrival_step": rng.randint(0, spread),
                "prompt_token_ids": prompt,
                "max_tokens": max_tokens,
                "priority": rng.choice([0, 0, 1, 2, -1, 5]) if config["policy"] == "priority" else 0,
            }
        )
    requests.sort(key=lambda r: r["arrival_step"])
    if rng.random() < 0.35:
        # Memory pressure: every request fits the pool alone (none refused), but not all together.
        need = max(
            (-(-(min(len(r["prompt_token_ids"]) + r["max_tokens"], max_model_len) - 1) // block_size)
             for r in requests if 0 < len(r["prompt_token_ids"]) < max_model_len),
            default=1,
        )
        config["num_blocks"] = max(1, need + rng.choice([0, 0, 1, 2, need // 2, need]))
    return {"config": config, "requests": requests}


# Running both sides -------------------------------------------------------------------------------
def run_tokenloom(trace: dict[str, Any]) -> dict[str, Any]:
    try:
        return tokenloom_replay(trace)
    except ConfigError as exc:
        return {"invalid": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a crash is a result to report
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_vllm_batch(traces: list[dict[str, Any]], timeout: float = 3600) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "traces.json", Path(tmp) / "steps.json"
        src.write_text(json.dumps(traces))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(
            # vLLM's python: $TOKENLOOM_VLLM_PYTHON (or $VLLM_PYTHON), else the anchors' vllm-venv; the model
            # dir (its config and tokenizer only): the anchors' smollm2-hf
            [envs.TOKENLOOM_VLLM_PYTHON, str(HERE / "vllm_replay.py"), "--batch", str(src), "-o", str(dst),
             "--model-dir", str(envs.TOKENLOOM_ANCHORS_DIR / "smollm2-hf")],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode != 0 or not dst.exists():
            raise RuntimeError(f"vllm_replay.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(dst.read_text())


def run_vllm(traces: list[dict[str, Any]], batch_size: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(0, len(traces), batch_size):
        out.extend(run_vllm_batch(traces[i : i + batch_size]))
    return out


# Diffing ------------------------------------------------------------------------------------------
def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, int | None] | None:
    """(field, step index) of the first difference, or None if identical."""
    for kind in ("invalid", "error"):
        if (kind in ours) != (kind in theirs):
            return (kind, None)
    if "invalid" in ours or "error" in ours:
        return None if "invalid" in ours else ("error", None)
    if ours["summary"]["rejected"] != theirs["summary"]["rejected"]:
        return ("rejected", None)
    a, b = ours["steps"], theirs["steps"]
    for i in range(min(len(a), len(b))):
        for f in STEP_FIELDS:
            if f == "cached_tokens" or f == "scheduled":
                same = a[i][f] == b[i][f] and list(a[i][f]) == list(b[i][f])  # order too
            else:
                same = a[i][f] == b[i][f]
            if not same:
                return (f, i)
    if len(a) != len(b):
        return ("num_steps", min(len(a), len(b)))
    return None


def describe(trace: dict[str, Any], ours: dict[str, Any], theirs: dict[str, Any], diff: tuple[str, int | None],
             context: int = 2) -> str:
    field, i = diff
    lines = [f"  config: {json.dumps(trace['config'])}"]
    for r in trace["requests"]:
        lines.append(
            f"    {r['id']}: arrive {r['arrival_step']} prompt {len(r['prompt_token_ids'])} "
            f"max_tokens {r['max_tokens']} prio {r['priority']}"
        )
    if i is None:
        lines.append(f"  first difference: {field}")
        for side, res in (("tokenloom", ours), ("vllm", theirs)):
            brief = res.get("invalid") or res.get("error") or res["summary"]["rejected"]
            lines.append(f"    {side:9}: {brief}")
        return "\n".join(lines)
    lines.append(f"  first difference: {field} at step {i}")
    for j in range(max(0, i - context), i + 1):
        for side, res in (("tokenloom", ours), ("vllm", theirs)):
            s = res["steps"][j] if j < len(res["steps"]) else None
            mark = ">>" if j == i else "  "
            lines.append(f"  {mark} {side:9} {json.dumps(s)}")
    return "\n".join(lines)


# Feature tags for picking diverse regression cases -------------------------------------------------
def features(trace: dict[str, Any], steps: dict[str, Any]) -> set[str]:
    cfg = trace["config"]
    tags: set[str] = set()
    if "steps" not in steps:
        return tags
    st = steps["steps"]
    if any(s["preempted"] for s in st):
        tags.add(f"preempt_{cfg['policy']}")
    if any(v > 0 for s in st for v in s["cached_tokens"].values()):
        tags.add("prefix_hit")
    admitted = sum(len(s["cached_tokens"]) for s in st)
    if cfg.get("enable_prefix_caching", True) and admitted > len({r for s in st for r in s["cached_tokens"]}):
        tags.add("readmission")
    if not cfg["enable_chunked_prefill"]:
        tags.add("chunked_off")
    if cfg["long_prefill_token_threshold"]:
        tags.add("threshold")
    if any(len(s["scheduled"]) == cfg["max_num_seqs"] for s in st) and len(trace["requests"]) > cfg["max_num_seqs"]:
        tags.add("max_num_seqs")
    if any(not s["scheduled"] for s in st):
        tags.add("idle_step")
    if steps["summary"]["rejected"]:
        tags.add("rejected")
    mml = cfg["max_model_len"]
    if any(len(r["prompt_token_ids"]) + r["max_tokens"] > mml and r["id"] not in steps["summary"]["rejected"]
           for r in trace["requests"]):
        tags.add("max_model_len_cap")
    if cfg.get("watermark"):
        tags.add("watermark")
    if cfg.get("scheduler_reserve_full_isl") is False:
        tags.add("no_reserve_full_isl")
    return tags


# Decision paths inside tokenloom's scheduler a trace drives (the first line of a branch's body, found
# by text so line edits do not break it). Outputs are identical on both sides, so these are vLLM's paths
# too (vllm/v1/core/sched/scheduler.py, same structure).
_PATH_TAGS = {
    "running_threshold": ("scheduler", "if 0 < threshold < num_new_tokens:", 1, 0),
    "victim_before_current": ("scheduler", "if victim_index < req_index:", 1, 0),
    "victim_unscheduled": ("scheduler", "if victim in scheduled_running_reqs:", 1, 0),
    "self_preempt": ("scheduler", "if victim is request:", 1, 0),
    "chunked_off_break": ("scheduler", "if not cfg.enable_chunked_prefill and num_new_tokens > token_budget:", 1, 0),
    "admission_kv_refused": ("scheduler", 'bound_by = "kv_blocks"', 0, 2),
    "full_isl_refused": ("kv_cache_manager", "if need + watermark > num_free:", 1, 0),
    "hit_on_free_block": ("block_pool", "self.free_block_queue.remove(block)", 0, 0),
    "evict_cached_block": ("block_pool", "same = self.cached_block_hash_to_block.get(block_hash)", 0, 0),
}


def path_tags(trace: dict[str, Any]) -> set[str]:
    """Run tokenloom on the trace under a line tracer and name the decision paths it took."""
    import importlib

    targets: dict[tuple[str, int], str] = {}
    for tag, (module, text, offset, nth) in _PATH_TAGS.items():
        mod = importlib.import_module(f"tokenloom.core.{module}")
        lines = Path(mod.__file__).read_text().splitlines()
        hits = [i for i, line in enumerate(lines, 1) if line.strip() == text]
        if len(hits) > nth:
            lineno = hits[nth]
            for _ in range(offset):  # the offset-th following line of code (comments emit no events)
                lineno += 1
                while not lines[lineno - 1].strip() or lines[lineno - 1].strip().startswith("#"):
                    lineno += 1
            targets[(mod.__file__, lineno)] = tag
    files = {f for f, _ in targets}
    seen: set[str] = set()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename not in files:
            return None

        def line_tracer(f: Any, e: str, a: Any) -> Any:
            if e == "line" and (tag := targets.get((f.f_code.co_filename, f.f_lineno))):
                seen.add(tag)
            return line_tracer

        return line_tracer

    sys.settrace(tracer)
    try:
        run_tokenloom(trace)
    finally:
        sys.settrace(None)
    return seen


def save_case(name: str, trace: dict[str, Any], expected: dict[str, Any], note: str = "") -> Path:
    CASES_DIR.mkdir(parents=True, exist_ok=True)
    path = CASES_DIR / f"{name}.json"
    path.write_text(json.dumps({"note": note, "trace": trace, "expected": expected}, indent=None) + "\n")
    return path


# Main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--num-traces", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=200, help="traces per vLLM subprocess")
    parser.add_argument("--cases", action="store_true", help="re-check the saved cases against vLLM instead")
    parser.add_argument("--no-save", action="store_true", help="do not save mismatching traces")
    parser.add_argument("--save-diverse", type=int, default=0, metavar="K",
                        help="also save up to K matching traces per feature tag as regression cases")
    parser.add_argument("--show", type=int, default=10, help="print at most this many mismatches in full")
    args = parser.parse_args(argv)

    if args.cases:
        paths = sorted(CASES_DIR.glob("*.json"))
        names = [p.stem for p in paths]
        traces = [json.loads(p.read_text())["trace"] for p in paths]
    else:
        rng = random.Random(args.seed)
        traces = [random_trace(rng) for _ in range(args.num_traces)]
        names = [f"seed{args.seed}_{i:04d}" for i in range(len(traces))]

    t0 = time.time()
    theirs_all = run_vllm(traces, args.batch_size)
    t1 = time.time()
    ours_all = [run_tokenloom(t) for t in traces]
    t2 = time.time()

    by_field: Counter[str] = Counter()
    invalid = identical = 0
    mismatches = []
    tag_counts: Counter[str] = Counter()
    candidates: dict[str, list[tuple[int, str, dict[str, Any], dict[str, Any], set[str]]]] = {}
    for name, trace, ours, theirs in zip(names, traces, ours_all, theirs_all):
        diff = first_difference(ours, theirs)
        if diff is None:
            if "invalid" in ours:
                invalid += 1
                continue
            identical += 1
            tags = features(trace, theirs)
            if args.save_diverse:
                tags |= path_tags(trace)
                size = len(json.dumps(trace)) + len(json.dumps(theirs))
                for tag in tags:
                    candidates.setdefault(tag, []).append((size, name, trace, theirs, tags))
            tag_counts.update(tags)
            continue
        by_field[diff[0]] += 1
        mismatches.append((name, trace, ours, theirs, diff))

    if args.save_diverse and not args.cases:
        # The smallest matching traces that show each feature, K per feature, as regression cases.
        chosen: dict[str, tuple[str, dict[str, Any], dict[str, Any], set[str]]] = {}
        for tag in sorted(candidates):
            smallest = sorted(candidates[tag], key=lambda c: (c[0], c[1]))[: args.save_diverse]
            for _, name, trace, theirs, tags in smallest:
                chosen.setdefault(name, (tag, trace, theirs, tags))
        for name, (tag, trace, theirs, tags) in sorted(chosen.items()):
            save_case(f"{tag}__{name}", trace, theirs, note="matching; features: " + ", ".join(sorted(tags)))
        print(f"saved {len(chosen)} diverse cases under {CASES_DIR}")

    for k, (name, trace, ours, theirs, diff) in enumerate(mismatches):
        if k < args.show:
            print(f"MISMATCH {name}")
            print(describe(trace, ours, theirs, diff))
        if not args.no_save and not args.cases and "steps" in theirs:
            save_case(name, trace, theirs, note=f"mismatch when found: {diff[0]}")

    compared = len(traces) - invalid
    print()
    print(f"traces: {len(traces)}  invalid on both sides (config rules): {invalid}")
    print(f"traces compared:  {compared}  identical: {identical}  differing: {len(mismatches)}")
    if by_field:
        print("differing by first field: " + ", ".join(f"{k}={v}" for k, v in by_field.most_common()))
    print("features among identical traces: " + ", ".join(f"{k}={v}" for k, v in sorted(tag_counts.items())))
    print(f"time: vLLM {t1 - t0:.1f}s, tokenloom {t2 - t1:.1f}s")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
