# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/detokenizer/test_disable_detokenization.py, unchanged but for the plumbing:
# the imports point at tokenloom, and the LLM runs the default model (model=None) for distilgpt2, which is on
# the Hub.

import pytest

from tokenloom import LLM
from tokenloom.sampling_params import SamplingParams


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "model-specific: greedy on this raw prompt, SmolLM2-135M-Instruct's first token is its EOS (<|im_end|>, id 2), "
    "so the detokenized text is empty as well (the token ids of both runs agree, [2]); distilgpt2 writes words"))
@pytest.mark.parametrize("model", ["distilbert/distilgpt2"])
def test_computed_prefix_blocks(model: str):
    # This test checks if the engine generates completions both with and
    # without optional detokenization, that detokenization includes text
    # and no-detokenization doesn't, and that both completions have the same
    # token_ids.
    prompt = (
        "You are a helpful assistant. How do I build a car from cardboard and "
        "paper clips? Is there an easy to follow video tutorial available "
        "online for free?"
    )

    llm = LLM(model=None)
    sampling_params = SamplingParams(max_tokens=10, temperature=0.0, detokenize=False)

    outputs_no_detokenization = llm.generate(prompt, sampling_params)[0].outputs[0]
    sampling_params.detokenize = True
    outputs_with_detokenization = llm.generate(prompt, sampling_params)[0].outputs[0]

    assert outputs_no_detokenization.text == ""
    assert outputs_with_detokenization.text != ""
    assert outputs_no_detokenization.token_ids == outputs_with_detokenization.token_ids
