# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/test_outputs.py, unchanged but for the plumbing: the import points at
# tokenloom's RequestOutput (tokenloom.engine.outputs, vLLM's vllm.outputs). Left out, vLLM-only machinery:
# test_specialized_pooling_outputs_preserve_request_error (vLLM's RequestError, the structured error its
# multimodal processor cache misses give pooling outputs; tokenloom serves text models and a pooling output's
# error is a message) and test_request_output_add_preserves_terminal_spec_decode_metrics (vLLM's per-request
# speculative-decoding metrics, --per-request-spec-decode-metrics, which tokenloom does not have).

import pytest

from tokenloom.engine.outputs import RequestOutput

pytestmark = pytest.mark.cpu_test


def test_request_output_forward_compatible():
    output = RequestOutput(
        request_id="test_request_id",
        prompt="test prompt",
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[],
        finished=False,
        example_arg_added_in_new_version="some_value",
    )
    assert output is not None
