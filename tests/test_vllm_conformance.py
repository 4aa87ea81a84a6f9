"""tokenloom's step replay must decide exactly what vLLM 0.32's real V1 scheduler decides.

Each case in benchmarks/vllm_conformance/cases/ holds a trace and vLLM's STEPS for it, recorded by
benchmarks/vllm_conformance/vllm_replay.py (driving vllm.v1.core.sched.scheduler.Scheduler), so this
test needs no vLLM install. Regenerate or extend the cases with benchmarks/vllm_conformance/compare.py
(see docs/conformance.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenloom.core.replay import replay

CASES_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_conformance" / "cases"
CASES = sorted(CASES_DIR.glob("*.json"))
STEP_FIELDS = ("step", "scheduled", "preempted", "finished", "num_free_blocks", "cached_tokens")


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 30, f"only {len(CASES)} conformance cases in {CASES_DIR}"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_replay_matches_vllm(path: Path) -> None:
    case = _load(path)
    expected = case["expected"]
    result = replay(case["trace"])

    assert result["summary"]["rejected"] == expected["summary"]["rejected"]
    ours, theirs = result["steps"], expected["steps"]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for field in STEP_FIELDS:
            assert a[field] == b[field], f"step {i}, {field}: tokenloom {a[field]!r} != vLLM {b[field]!r}"
        # Dict order is the order of scheduling (running first, then admissions): it must match too.
        assert list(a["scheduled"]) == list(b["scheduled"]), f"step {i}: scheduling order differs"
        assert list(a["cached_tokens"]) == list(b["cached_tokens"]), f"step {i}: admission order differs"
    assert len(ours) == len(theirs), f"tokenloom ran {len(ours)} steps, vLLM {len(theirs)}"


def test_cases_cover_the_features() -> None:
    """The saved cases exercise what the conformance suite is meant to pin down."""
    tags: set[str] = set()
    for path in CASES:
        case = _load(path)
        cfg, steps = case["trace"]["config"], case["expected"]["steps"]
        if any(s["preempted"] for s in steps):
            tags.add(f"preempt_{cfg['policy']}")
        if any(v > 0 for s in steps for v in s["cached_tokens"].values()):
            tags.add("prefix_hit")
        if not cfg["enable_chunked_prefill"]:
            tags.add("chunked_off")
        if cfg["long_prefill_token_threshold"]:
            tags.add("threshold")
        if any(not s["scheduled"] for s in steps):
            tags.add("idle_step")
        if case["expected"]["summary"]["rejected"]:
            tags.add("rejected")
        if cfg.get("watermark"):
            tags.add("watermark")
    missing = {"preempt_fcfs", "preempt_priority", "prefix_hit", "chunked_off", "threshold", "idle_step",
               "rejected", "watermark"} - tags
    assert not missing, f"no saved case exercises: {sorted(missing)}"
