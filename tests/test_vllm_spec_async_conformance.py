"""tokenloom's replay of speculative-decoding / async-scheduling traces must decide exactly what vLLM
0.32's real Scheduler / AsyncScheduler decides.

Each case in benchmarks/vllm_conformance/cases_spec_async/ holds a random trace (K in 0..4, async on
or off, tight budgets and pools: drafts cut by the budget, preemption with a step in flight, output
arriving after its request finished, padded first decodes, prefix hits) and vLLM's STEPS for it,
recorded by benchmarks/vllm_conformance/vllm_replay_spec.py; regenerate or extend them with
benchmarks/vllm_conformance/compare_spec_async.py --save-dir (docs/conformance.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloom.core.replay import replay

CASES_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_conformance" / "cases_spec_async"
CASES = sorted(CASES_DIR.glob("*.json"))
FIELDS = ("step", "scheduled", "preempted", "finished", "num_free_blocks")
SPEC_FIELDS = ("spec", "pending_drafts")  # with drafts (num_speculative_tokens > 0)
ASYNC_FIELDS = ("events", "placeholders")  # with async scheduling


def test_the_cases_cover_async_with_drafts() -> None:
    cases = [json.loads(p.read_text()) for p in CASES]
    async_spec = [c for c in cases if c["trace"]["config"]["async_scheduling"]
                  and c["trace"]["config"]["num_speculative_tokens"] > 0]
    assert len(async_spec) >= 20
    steps = [s for c in async_spec for s in c["expected"]["steps"]]
    assert any(s["preempted"] for s in steps)
    assert any(a > 0 for s in steps for _, a in s.get("spec", {}).values())  # accepted drafts
    assert any(c["trace"]["config"]["enable_prefix_caching"] for c in async_spec)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_replay_matches_vllm(path: Path) -> None:
    case = json.loads(path.read_text())
    trace, expected = case["trace"], case["expected"]
    result = replay(trace)
    ours, theirs = result["steps"], expected["steps"]
    cfg = trace["config"]
    # Every field the configuration calls for is compared, and must be in both records: a field missing
    # from vLLM's recording or from tokenloom's replay is a failure, not a skip.
    fields = (FIELDS + (SPEC_FIELDS if cfg["num_speculative_tokens"] > 0 else ())
              + (ASYNC_FIELDS if cfg["async_scheduling"] else ())
              + (("cached_tokens",) if cfg.get("enable_prefix_caching", True) else ()))
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for field in fields:
            assert field in b, f"step {i}: vLLM's recording has no {field!r}"
            assert field in a, f"step {i}: tokenloom's replay has no {field!r}"
            assert a[field] == b[field], f"step {i}, {field}: tokenloom {a[field]!r} != vLLM {b[field]!r}"
        assert list(a["scheduled"]) == list(b["scheduled"]), f"step {i}: scheduling order differs"
    assert len(ours) == len(theirs), f"tokenloom ran {len(ours)} steps, vLLM {len(theirs)}"
    assert result["summary"]["rejected"] == expected["summary"]["rejected"]
    if "spec_decoding" in expected["summary"]:
        assert result["summary"]["spec_decoding"] == expected["summary"]["spec_decoding"]
