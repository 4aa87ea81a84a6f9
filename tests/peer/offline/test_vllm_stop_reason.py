# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/detokenizer/test_stop_reason.py, unchanged but for the plumbing: the imports
# point at tokenloom, `vllm_runner` (tests/peer/offline/conftest.py) runs the default model for distilgpt2, and
# `transformers` is conftest.py's module, whose AutoTokenizer loads the served model's tokenizer (the stop token
# is that tokenizer's ".").
"""Test the different finish_reason="stop" situations during generation:
    1. One of the provided stop strings
    2. One of the provided stop tokens
    3. The EOS token

Run `pytest tests/engine/test_stop_reason.py`.
"""

import pytest

from tests.peer.offline import conftest as transformers  # its AutoTokenizer: the served model's
from tokenloom import SamplingParams

MODEL = "distilbert/distilgpt2"
STOP_STR = "."
SEED = 42
MAX_TOKENS = 1024


@pytest.fixture
def vllm_model(vllm_runner):
    with vllm_runner(MODEL) as vllm_model:
        yield vllm_model


def test_stop_reason(vllm_model, example_prompts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    stop_token_id = tokenizer.convert_tokens_to_ids(STOP_STR)
    llm = vllm_model.llm

    # test stop token
    outputs = llm.generate(
        example_prompts,
        sampling_params=SamplingParams(
            ignore_eos=True,
            seed=SEED,
            max_tokens=MAX_TOKENS,
            stop_token_ids=[stop_token_id],
        ),
    )
    for output in outputs:
        output = output.outputs[0]
        assert output.finish_reason == "stop"
        assert output.stop_reason == stop_token_id

    # test stop string
    outputs = llm.generate(
        example_prompts,
        sampling_params=SamplingParams(
            ignore_eos=True, seed=SEED, max_tokens=MAX_TOKENS, stop="."
        ),
    )
    for output in outputs:
        output = output.outputs[0]
        assert output.finish_reason == "stop"
        assert output.stop_reason == STOP_STR

    # test EOS token
    outputs = llm.generate(
        example_prompts,
        sampling_params=SamplingParams(seed=SEED, max_tokens=MAX_TOKENS),
    )
    for output in outputs:
        output = output.outputs[0]
        assert output.finish_reason == "length" or (
            output.finish_reason == "stop" and output.stop_reason is None
        )
