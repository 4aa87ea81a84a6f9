"""Plumbing that lets vLLM's request-level tests (tests/test_request_input_bounds.py, tests/v1/...) run against
tokenloom: vLLM's names and constructor shapes mapped onto tokenloom's, never behaviour. Anything a test asserts
is tokenloom's own answer.

`InputProcessor.process_inputs` is vLLM's entry point of its input processor, called by the tests on a mock
that holds only a model config (`model_config.max_model_len`) and no tokenizer: here it runs tokenloom's
InputProcessor (tokenloom/engine/input_processor.py: the prompt's checks, then `process_params`, which fills an
unset max_tokens from the context as vLLM's does) on an engine description with that max_model_len, and returns
what tokenloom sends its engine core, an EngineCoreRequest.
"""

from __future__ import annotations

from typing import Any

from tokenloom.engine.core_messages import EngineCoreRequest, EngineReady
from tokenloom.engine.input_processor import InputProcessor as _TLInputProcessor
from tokenloom.sampling_params import SamplingParams

# A vocabulary and a KV pool that hold what the tests send (prompts of a few small token ids).
_VOCAB_SIZE = 32000
_BLOCK_SIZE = 16


class InputProcessor:
    """vLLM's InputProcessor, as far as its tests call it: `process_inputs` on an object with `model_config`
    (and `tokenizer`, None: token-id prompts only)."""

    tokenizer: Any = None
    model_config: Any = None
    generation_config_fields: Any = None
    renderer: Any = None
    vllm_config: Any = None

    def process_inputs(self, request_id: str, prompt: dict[str, Any], params: SamplingParams,
                       supported_tasks: tuple[str, ...] = ("generate",)) -> EngineCoreRequest:
        max_model_len = self.model_config.max_model_len
        info = EngineReady(model_name="test-model", max_model_len=max_model_len,
                           num_blocks=max_model_len // _BLOCK_SIZE + 1, block_size=_BLOCK_SIZE, eos_token_id=None,
                           vocab_size=_VOCAB_SIZE, dtype="float32", device="cpu", load_time_s=0.0)
        processor = _TLInputProcessor(self.tokenizer, info)
        _, prompt_token_ids = processor.tokenize({"prompt_token_ids": prompt["prompt_token_ids"]})
        processor.check_prompt(prompt_token_ids, params, max_tokens_in_context=False)
        params = processor.process_params(params, len(prompt_token_ids))
        return EngineCoreRequest(request_id, prompt_token_ids, params, arrival_time=0.0)


class _Platform:
    """vLLM's current_platform, as its tests probe it: tokenloom runs on CPU (or CUDA), never ROCm or XPU."""

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_xpu() -> bool:
        return False


current_platform = _Platform()
