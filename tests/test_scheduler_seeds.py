"""The seeds' worked examples, as written (../shared/seeds/). Where a seed's simplified model breaks
a config rule, the rule is kept and the same phenomenon is shown within valid settings."""

from __future__ import annotations

import pytest

from tests.sched_utils import create_requests, create_scheduler, step
from tokenloom.config import ConfigError, SchedulerConfig
from tokenloom.core.replay import replay


def test_three_request_timeline_001_section4() -> None:
    """Budget 6, per-request prefill cap 4; A(4,2) B(8,3) at step 0, C(3,2) at step 1."""
    trace = {
        "config": {"max_num_batched_tokens": 6, "max_num_seqs": 4, "enable_chunked_prefill": True,
                   "long_prefill_token_threshold": 4, "block_size": 4, "num_blocks": 64,
                   "policy": "fcfs", "enable_prefix_caching": False, "max_model_len": 64},
        "requests": [
            {"id": "A", "arrival_step": 0, "prompt_token_ids": [1] * 4, "max_tokens": 2, "priority": 0},
            {"id": "B", "arrival_step": 0, "prompt_token_ids": [2] * 8, "max_tokens": 3, "priority": 0},
            {"id": "C", "arrival_step": 1, "prompt_token_ids": [3] * 3, "max_tokens": 2, "priority": 0},
        ],
    }
    result = replay(trace)
    scheduled = [s["scheduled"] for s in result["steps"]]
    assert scheduled == [{"A": 4, "B": 2}, {"A": 1, "B": 4, "C": 1}, {"B": 2, "C": 2}, {"B": 1, "C": 1}, {"B": 1}]
    assert result["summary"]["total_scheduled_tokens"] == 19
    # Each request feeds P + G - 1 positions to the model: A=5, B=10, C=4.
    per_request = {}
    for s in scheduled:
        for rid, n in s.items():
            per_request[rid] = per_request.get(rid, 0) + n
    assert per_request == {"A": 5, "B": 10, "C": 4}
    assert [s["finished"] for s in result["steps"]] == [[], ["A"], [], ["C"], ["B"]]
    assert result["steps"][-1]["num_free_blocks"] == 64


def _decodes_then_prefill(num_decodes: int, prompt_len: int, budget: int, max_num_seqs: int, **kw):
    """D running requests in decode (each lacks 1 token), then one waiting prefill of P tokens."""
    sched = create_scheduler(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=kw.pop("max_model_len", 512), **kw)
    for r in create_requests(num_decodes, num_tokens=1, max_tokens=1000, prefix="d"):
        sched.add_request(r)
    step(sched)  # one-token prompts: all prefilled, each sampled its first token
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running)
    (prefill,) = create_requests(1, num_tokens=prompt_len, max_tokens=10, prefix="p")
    sched.add_request(prefill)
    return sched, prefill


@pytest.mark.parametrize(
    "budget, max_seqs, decodes_scheduled, prefill_tokens, left",
    [
        # Table 3, B=16 and B=32 rows (D=10, P=24). The seed's M=32 with B=16 breaks
        # max_num_batched_tokens >= max_num_seqs, so that row runs with M=16 (still > D).
        (16, 16, 10, 6, 18),
        (32, 32, 10, 22, 2),
        # Table 3's B=8 row has B < M, which vLLM rejects (max_num_batched_tokens >= max_num_seqs).
        # The same phenomenon in valid settings: running decodes use the whole budget, prefill gets 0.
        (10, 10, 10, 0, 24),
    ],
)
def test_table3_budget_decides_who_is_served(budget, max_seqs, decodes_scheduled, prefill_tokens, left) -> None:
    sched, prefill = _decodes_then_prefill(10, 24, budget, max_seqs)
    out, _ = step(sched)
    decodes = sum(n for rid, n in out.num_scheduled_tokens.items() if rid.startswith("d"))
    assert decodes == decodes_scheduled
    assert out.num_scheduled_tokens.get("p0", 0) == prefill_tokens
    assert prefill.num_prompt_tokens - prefill.num_computed_tokens == left


def test_table3_b8_row_is_an_invalid_config() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens .* must be >= max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=32)


def test_group_a_shared_budget_prefill_takes_four_steps() -> None:
    """Group A: D=10, P=24, B=16 (M=16, not the seed's 32, to keep B >= M): 6 tokens a step, 4 steps."""
    sched, prefill = _decodes_then_prefill(10, 24, 16, 16)
    chunks = []
    while prefill.num_output_tokens == 0:
        out, _ = step(sched)
        chunks.append(out.num_scheduled_tokens.get("p0", 0))
        assert out.total_num_scheduled_tokens == 16
    assert chunks == [6, 6, 6, 6]


def test_group_b_budget_eaten_by_decodes_prefill_starves() -> None:
    """Group B: D=16, P=24, B=16 — every step the prefill gets 0 tokens; it never completes.

    With M=16 (the seed's 32 would break B >= M) max_num_seqs would also bind, but the budget is
    checked first, exactly as in vLLM's waiting loop (`while token_budget > 0`)."""
    sched, prefill = _decodes_then_prefill(16, 24, 16, 16)
    for _ in range(20):
        out, _ = step(sched)
        assert "p0" not in out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == 16
        assert out.bound_by == "budget"
    assert prefill.num_computed_tokens == 0 and prefill in list(sched.waiting)


def test_chunked_prefill_off_breaks_instead_of_cutting() -> None:
    """Chunked off: a waiting prompt that does not fit the budget left is not scheduled at all."""
    sched, prefill = _decodes_then_prefill(10, 24, 32, 32, enable_chunked_prefill=False, max_model_len=32)
    for _ in range(5):
        out, _ = step(sched)
        assert "p0" not in out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == 10  # 22 tokens of budget stay idle
    # The same step with chunking on cuts the prompt to the budget left.
    sched_on, _ = _decodes_then_prefill(10, 24, 32, 32, enable_chunked_prefill=True, max_model_len=32)
    out, _ = step(sched_on)
    assert out.num_scheduled_tokens["p0"] == 22


def test_chunked_off_does_not_skip_the_long_head() -> None:
    """vLLM test_schedule_order: budget 1024, max_num_seqs 3, 2x800 then 2x10 tokens."""
    for chunked, expected in ((True, 2), (False, 1)):
        sched = create_scheduler(max_num_batched_tokens=1024, max_num_seqs=3, max_model_len=1024,
                                 enable_chunked_prefill=chunked)
        for r in create_requests(2, num_tokens=800) + create_requests(2, num_tokens=10, prefix="s"):
            sched.add_request(r)
        out = sched.schedule()
        assert len(out.scheduled_new_reqs) == expected
