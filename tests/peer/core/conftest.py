"""tests/peer/core: vLLM's scheduler-level tests on tokenloom.core (vllm_shim.py is the plumbing).

vLLM's random priority blast (test_vllm_priority_scheduler_random.py: 20,000 steps a case, 12 cases, 5.5
minutes together on 2 cores) would take a third of the suite's 15 minutes, so `make test` runs only its
quickest case (the preemption profile without drafts or prefix caching: a few seconds) and `make test-peer`
(TOKENLOOM_PEER_FULL=1) all twelve. What it checks, the step's outputs consistent under
random traffic and preemption, is also checked on random traces by tests/test_scheduler_properties.py
(token counts that add up within the budget, under both policies) and, with drafts,
tests/test_async_spec_scheduler.py.
"""

from __future__ import annotations

import os

import pytest

_FULL_RUN_ONLY = {"test_vllm_priority_scheduler_random.py::test_priority_scheduling_blast"}
_IN_EVERY_RUN = {"test_vllm_priority_scheduler_random.py::test_priority_scheduling_blast[preemption-None-False]"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TOKENLOOM_PEER_FULL"):
        return
    skip = pytest.mark.skip(reason="a long vendored case: run by `make test-peer` (TOKENLOOM_PEER_FULL=1)")
    for item in items:
        if f"{item.path.name}::{item.name}" in _IN_EVERY_RUN:
            continue
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in _FULL_RUN_ONLY:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's (its CPU CI selects these tests)")
