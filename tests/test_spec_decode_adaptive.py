"""The opt-in adaptive drafting policy: a batch cap on verification rows and an acceptance gate."""

from __future__ import annotations

from tokenloom.config import SpeculativeConfig
from tokenloom.spec_decode.adaptive import AdaptiveDraftPolicy


def _policy(**kw) -> AdaptiveDraftPolicy:
    return AdaptiveDraftPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True, **kw))


def test_batch_cap_shares_rows_among_decoding_requests():
    p = _policy(adaptive_max_batch_tokens=64)
    assert p.num_drafts(1) == 4  # single stream: all K
    assert p.num_drafts(16) == 3  # 64 // 16 - 1
    assert p.num_drafts(40) == 0  # compute-bound: no drafts
    drafts = [[1, 2, 3, 4]] * 16
    assert p.trim([str(i) for i in range(16)], drafts, num_decoding=16) == [[1, 2, 3]] * 16


def test_acceptance_gate_stops_and_retries():
    p = _policy(adaptive_min_acceptance=0.3)
    for _ in range(5):
        p.observe({"bad": [4, 0], "good": [4, 4]})
    out = p.trim(["bad", "good"], [[1, 2], [3, 4]], num_decoding=2)
    assert out == [[], [3, 4]]
    # Without drafting, the estimate drifts back toward the prior until the request tries again.
    tries = 0
    while p.trim(["bad"], [[1]], num_decoding=1) == [[]]:
        tries += 1
        assert tries < 200
    assert tries > 0
    p.forget(["bad"])
    assert "bad" not in p.acceptance


def test_off_by_default():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).adaptive is False
