# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/structured_output/test_request.py, unchanged but for the imports:
# StructuredOutputRequest is tokenloom's (tokenloom/core/structured_output.py) under vLLM's constructor and grammar
# setter (tests/peer/structured/vllm_shim.py); `is_grammar_ready` and `grammar` are tokenloom's.
"""Unit tests for StructuredOutputRequest grammar-future polling."""

from concurrent.futures import Future

from tests.peer.structured.vllm_shim import StructuredOutputRequest, StructuredOutputsParams


def _request_with_future(fut: Future) -> StructuredOutputRequest:
    req = StructuredOutputRequest(params=StructuredOutputsParams(regex="a+"))
    req.grammar = fut
    return req


def test_pending_grammar_future_is_not_ready():
    req = _request_with_future(Future())
    assert not req.is_grammar_ready
    assert req.grammar is None


def test_grammar_compile_raising_timeout_error_is_a_failure():
    """A compile that raised TimeoutError must be treated as a failed compile,
    not as still-compiling (#53130)."""
    fut: Future = Future()
    fut.set_exception(TimeoutError("compiler timed out"))
    req = _request_with_future(fut)
    assert req.is_grammar_ready
    assert isinstance(req.grammar, TimeoutError)
