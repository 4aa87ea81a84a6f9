"""The default model, end to end: greedy tokens equal Hugging Face transformers' greedy generation."""

from __future__ import annotations

import pytest
import torch

from tokenloom.engine.llm import LLM
from tokenloom.sampling_params import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for writing clean Python code.",
    "Why is the sky blue?",
]
NEW_TOKENS = 40  # past the first sentence of every answer


@pytest.mark.slow
def test_greedy_equals_transformers_on_8_chat_prompts(transformers_default_model) -> None:
    # The dequantized float path (quantization="none") is what transformers runs; the default keeps the
    # GGUF blocks and quantizes activations (test_default_quantized_path_follows_float below).
    llm = LLM(dtype="float32", quantization="none", max_num_batched_tokens=256)  # small budget: prompts share steps
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
               for c in CHATS]
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)

    # Teacher-forced: one transformers forward over prompt + our tokens, whose argmax at every position must
    # be our next token (and EOS where we stopped early). That is transformers' greedy decoding of the same
    # prefix, without its 320 one-token forwards (the test's time, 29 s, was that loop).
    hf = transformers_default_model
    eos = tok.eos_token_id
    for prompt, out in zip(prompts, ours):
        got = list(out.outputs[0].token_ids)
        assert len(got) == NEW_TOKENS or got[-1] == eos, out.outputs[0].finish_reason
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + got])).logits[0]
        ref_ids = logits[len(prompt) - 1:len(prompt) - 1 + len(got)].argmax(-1).tolist()
        assert got == ref_ids, (out.outputs[0].text, tok.decode(ref_ids))
