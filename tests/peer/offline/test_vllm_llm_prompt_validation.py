# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/entrypoints/llm/test_prompt_validation.py, unchanged but for the
# plumbing: the imports point at tokenloom, and `vllm_runner` (tests/peer/offline/conftest.py) runs the default
# model for any name.

import pytest
import torch

from tokenloom.exceptions import VLLMValidationError


def test_empty_prompt(vllm_runner):
    with (
        vllm_runner("openai-community/gpt2", enforce_eager=True) as runner,
        pytest.raises(VLLMValidationError, match="decoder prompt cannot be empty"),
    ):
        runner.llm.generate([""])


def test_out_of_vocab_token(vllm_runner):
    with (
        vllm_runner("openai-community/gpt2", enforce_eager=True) as runner,
        pytest.raises(VLLMValidationError, match="out of vocabulary"),
    ):
        runner.llm.generate({"prompt_token_ids": [999999]})


@pytest.mark.xfail(strict=True, reason="multimodal (a LLaVA model, image embeddings): tokenloom serves text models; "
                   "enable_mm_embeds is not an engine argument, and a multi_modal_data prompt is refused by name")
def test_require_mm_embeds(vllm_runner):
    with (
        vllm_runner(
            "llava-hf/llava-1.5-7b-hf",
            enforce_eager=True,
            enable_mm_embeds=False,
        ) as runner,
        pytest.raises(ValueError, match="--enable-mm-embeds"),
    ):
        runner.llm.generate(
            {
                "prompt": "<image>",
                "multi_modal_data": {"image": torch.empty(1, 1, 1)},
            }
        )
