"""tests/peer/requests: vLLM 0.32.0's request-level tests (the bounds on what a request may ask for, sampling and
request objects, the engine's handling of a request that fails before it runs) on tokenloom; vllm_request_shim.py
is the plumbing. What is vendored, what is not and why: docs/vllm_peer.md, "Request level"."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's (no global clean-up after the test)")
    config.addinivalue_line("markers", "cpu_test: vLLM's (its CPU CI selects these tests)")
