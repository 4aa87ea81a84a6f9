"""The reasoning gate in a real engine, offline (vLLM's LLM(reasoning_parser=...)): a structured output constrains
only what follows the end of the reasoning, with async scheduling and n-gram drafts (drafts are checked
against the grammar only after the end; tests/test_reasoning_gate.py splits drafts across the end). An
engine-core process builds the same gate from its config (tests/test_reasoning_server.py's server runs one;
data-parallel engines are such processes).

The tiny Qwen3 of tests/reasoning_models.py is biased towards `</think>` (logit_bias): unconstrained, its first
token is that; after it the grammar (yes|no) masks `</think>` away. So the output is "</think>yes" or
"</think>no": a grammar applied from the first token would have refused the `</think>`."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

END_THINK = 321  # tests/reasoning_models.py: <think> 320, </think> 321


def test_async_scheduling_and_drafts_wait_for_the_end_of_reasoning(tiny_reasoning_model) -> None:
    llm = LLM(str(tiny_reasoning_model), reasoning_parser="qwen3", async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
              max_model_len=128)
    try:
        params = SamplingParams(max_tokens=12, logit_bias={END_THINK: 100.0},
                                structured_outputs=StructuredOutputsParams(regex="(yes|no)"))
        prompts = [f"yes no yes no {i} yes no" for i in range(3)]  # repeats: the n-gram proposer drafts
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out in outputs:
            assert out.outputs[0].text in ("</think>yes", "</think>no"), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"
        # The control: without a grammar the bias makes every token </think>.
        free = llm.generate(prompts[:1], SamplingParams(max_tokens=3, logit_bias={END_THINK: 100.0}), use_tqdm=False)
        assert free[0].outputs[0].token_ids[:3] == [END_THINK] * 3
    finally:
        llm.shutdown()
