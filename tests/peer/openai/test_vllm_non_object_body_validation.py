# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's
# tests/entrypoints/openai/chat_completion/test_non_object_body_validation.py (the 0.32.0 sdist from PyPI),
# unchanged but for the plumbing: vLLM's helpers (RemoteOpenAIServer, get_tokenizer, ...) come from tests/peer/openai/
# vllm_shim.py, which serves the default model (SmolLM2-135M-Instruct) under every name the file uses (the
# Hub is out of reach); pytest-asyncio's marker is anyio's (the plugin this repository runs), its fixture
# decorator pytest's. Skips and xfails, with their reasons: conftest.py.
# ChatCompletionRequest is tokenloom's request model; VLLMValidationError its APIError (vllm_shim.py).

"""Non-object JSON bodies must fail validation cleanly (4xx), not AttributeError (500).

mode=before validators that call data.get(...) without an isinstance(data, dict)
guard raise AttributeError for string/list/scalar bodies and surface as HTTP 500.
"""

import pytest
from pydantic import ValidationError

from tests.peer.openai.vllm_shim import ChatCompletionRequest, VLLMValidationError


@pytest.mark.parametrize(
    "payload",
    [
        "this is not valid json{{{",
        ["not", "an", "object"],
        42,
        None,
    ],
)
def test_chat_completion_request_rejects_non_object_body(payload):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(payload)


def test_chat_completion_request_cache_salt_still_validated_on_dict():
    with pytest.raises(VLLMValidationError, match="cache_salt"):
        ChatCompletionRequest.model_validate(
            {
                "model": "qwen",
                "messages": [{"role": "user", "content": "hello"}],
                "cache_salt": "",
            }
        )
