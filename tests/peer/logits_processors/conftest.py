"""tests/peer/logits_processors: vLLM 0.32.0's tests/v1/logits_processors/test_correctness.py on tokenloom's sampler
steps and thinking-budget tracker (vllm_sample_shim.py is the plumbing; docs/vllm_peer.md, "Structured outputs and
logits processors", lists what is vendored and why)."""

from __future__ import annotations

import os

import pytest

# The vendored cases that cost seconds each on 2 cores, run by `make test-peer` (TOKENLOOM_PEER_FULL=1) and skipped
# by `make test`; the per-row rules they drive are tests/test_sampler.py's, the batch bookkeeping
# tests/test_logits_processors.py's.
_FULL_RUN_ONLY = {
    "test_vllm_logitsprocs_correctness.py::test_logitsprocs",  # 6 batches of 50-200 requests, every token checked
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TOKENLOOM_PEER_FULL"):
        return
    skip = pytest.mark.skip(reason="a long vendored case: run by `make test-peer` (TOKENLOOM_PEER_FULL=1)")
    for item in items:
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in _FULL_RUN_ONLY:
            item.add_marker(skip)
