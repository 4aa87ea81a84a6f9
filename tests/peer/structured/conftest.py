"""tests/peer/structured: vLLM 0.32.0's structured-output unit tests (tests/v1/structured_output/) on tokenloom's
request checks, xgrammar backend and StructuredOutputManager; vllm_shim.py is the plumbing. What is vendored, what
is not and why: docs/vllm_peer.md, "Structured outputs and logits processors"."""

from __future__ import annotations

import sys

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's (its CPU CI selects these tests)")


# test_vllm_validation.py builds a 2,000-level schema with json.loads while it is collected. vLLM runs Python 3.12,
# whose json decoder recurses on the C stack, with a limit of its own; Python 3.11's counts against the interpreter's
# recursion limit (1,000). The limit is raised while that module is collected, then put back.
_DEEP_JSON_AT_COLLECTION = {"test_vllm_validation.py"}


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    if not (isinstance(collector, pytest.Module) and collector.path.name in _DEEP_JSON_AT_COLLECTION):
        return (yield)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5_000))
    try:
        return (yield)
    finally:
        sys.setrecursionlimit(limit)
