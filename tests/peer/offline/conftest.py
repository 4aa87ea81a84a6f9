# SPDX-License-Identifier: Apache-2.0
# The fixtures vLLM's offline tests take from vLLM's tests/conftest.py (`vllm_runner`, `example_prompts`), as
# stand-ins that run tokenloom: same names, constructor and methods, so a vendored test changes only its imports.
# example_prompts.txt is vLLM 0.32.0's tests/prompts/example.txt (SPDX-FileCopyrightText: Copyright contributors
# to the vLLM project), unchanged.
"""`vllm_runner` builds a tokenloom.LLM in place of vLLM's.

Every model a test names runs as the default model (SmolLM2-135M-Instruct, shipped with the package): the
tests' models live on the Hugging Face Hub, which the test machines cannot reach. `$TOKENLOOM_PEER_MODEL` names
another (a path or a registered name). vLLM's GPU and compiler knobs that tokenloom has no use for (kernel and
compilation configs, default_torch_num_threads) are dropped; every other keyword goes to `LLM` as it is, so an
argument tokenloom does not know fails the test loudly instead of being ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.sampling_params import BeamSearchParams

PROMPTS_FILE = Path(__file__).with_name("example_prompts.txt")
# vLLM's knob for its GPU build's threads; tokenloom sizes its own (kernel_config and compilation_config are engine
# arguments here, taken as vLLM's and changing nothing).
_DROPPED = ("default_torch_num_threads",)
# How vLLM reads the named checkpoint's weights: the model that runs is the default one (a GGUF), read as tokenloom
# reads it, as tokenizer_mode is (test_vllm_struct_output_generate.py asks load_format "hf" of Mistral's checkpoints,
# which names a Hugging Face directory). config_format ("auto", "hf") goes to LLM as it is.
_DROPPED += ("load_format",)
# vLLM's attention-backend choice (test_vllm_async_scheduling.py asks for FLEX_ATTENTION, to run float32).
_DROPPED += ("attention_config",)


# The vendored cases that cost most of the suite's 15-minute budget on 2 cores (each 10 to 35 s), run by
# `make test-peer` (TOKENLOOM_PEER_FULL=1) and skipped in `make test`; what they check is also in tokenloom's own
# tests (tests/test_beam_search*.py's concurrency_limit, ignore_eos across the suite, tests/test_vllm_async_api.py's
# aborts and cancellations).
_FULL_RUN_ONLY = {
    "test_vllm_beam_search.py::test_beam_search_with_concurrency_limit",  # 8 prompts x 4 beams x 64 tokens, twice
    # 4 prompts x 4 beams x 64 tokens against transformers' beam search (9-10 s); the same comparison on fewer
    # tokens is tests/test_beam_search.py::test_equals_a_beam_search_over_transformers_logprobs
    "test_vllm_beam_search.py::test_beam_search_single_input",
    "test_vllm_ignore_eos.py::test_ignore_eos",  # 8 prompts x 512 tokens
    "test_vllm_async_llm.py::test_abort",  # 100 requests x 100 tokens
    # 8 requests twice at a 32-token budget (10-20 s); its reset with running requests under async scheduling
    # is tests/test_async_scheduler.py::test_reset_with_running_requests_drops_the_in_flight_output_and_...
    "test_vllm_reset_prefix_cache_e2e.py::test_reset_prefix_cache_e2e",
    "test_vllm_stop_reason.py::test_stop_reason",  # 3 x 8 prompts sampled up to a "." or EOS (max_tokens 1024)
    "test_vllm_async_scheduling.py::test_without_spec_decoding",  # 3 engines x 4 parameter sets x 34 prompts
    # Two `tokenloom serve` starts (an entry point, then --logits-processors), 4 prompts x 20 tokens each; one
    # server with --logits-processors is tests/test_logits_processors.py::test_the_servers_flag_and_vllm_xargs
    "test_vllm_custom_logitsprocs_online.py::test_custom_logitsprocs",
    "test_vllm_custom_logitsprocs_online.py::test_invalid_custom_logitsproc_arg",
    # vLLM's determinism cases, 8-10 s each on 2 cores (a batch of 12-32 prompts against each one alone; the
    # inverse case without the mode); tests/test_batch_invariance.py holds the same properties in make test
    "test_vllm_batch_invariance.py::test_v1_generation_is_deterministic_across_batch_sizes_with_needle",
    "test_vllm_batch_invariance.py::test_logprobs_bitwise_batch_invariance_bs1_vs_bsN",
    "test_vllm_batch_invariance.py::test_logprobs_bitwise_batch_invariance_ragged_chunked_prefill",
    "test_vllm_batch_invariance.py::test_logprobs_without_batch_invariance_should_fail",
    # the same against `tokenloom serve` (one server start, 33 requests: ~15 s)
    "test_vllm_online_batch_invariance.py::test_logprobs_bitwise_batch_invariance_bs1_vs_bsN",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TOKENLOOM_PEER_FULL"):
        return
    skip = pytest.mark.skip(reason="a long vendored case: run by `make test-peer` (TOKENLOOM_PEER_FULL=1)")
    for item in items:
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in _FULL_RUN_ONLY:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's conftest marks: memory clean-up between its GPU tests, nothing to do here.
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's (no global clean-up after the test)")
    config.addinivalue_line("markers", "cpu_model: vLLM's (its CPU CI selects these tests)")
    config.addinivalue_line("markers", "flaky: vLLM's (pytest-rerunfailures' reruns, on ROCm only)")
    config.addinivalue_line("markers", "cpu_test: vLLM's (its CPU CI selects these tests)")


def _translate_vllm_kwargs(kwargs: dict[str, Any]) -> None:
    """vLLM's engine arguments that tokenloom spells otherwise, as tokenloom's."""
    # vLLM's KV block count includes its null block (block 0, never allocated); tokenloom's counts usable ones.
    blocks = kwargs.pop("num_gpu_blocks_override", None)
    if blocks is not None:
        kwargs["num_blocks"] = blocks - 1
    # vLLM's "uni" executor runs the worker in the engine's process, as tokenloom does for one rank.
    if kwargs.get("distributed_executor_backend") == "uni":
        del kwargs["distributed_executor_backend"]
    # vLLM's switch to IEEE float32 matmuls (test_vllm_async_scheduling.py sets it so that a row's numbers do not
    # depend on the batch it runs in): tokenloom's counterpart is the dequantized path. The default model is a
    # quantized GGUF, whose kernels round a row a little differently in a prefill (a recompute after preemption)
    # than in a decode step, enough to flip a greedy near-tie; the dequantized path's do not.
    if os.environ.get("VLLM_FLOAT32_MATMUL_PRECISION") == "highest":
        kwargs.setdefault("quantization", "none")


class VllmRunner:
    """vLLM's tests/conftest.py VllmRunner over tokenloom.LLM, with its test defaults (seed 0, max_model_len
    1024, block_size 16, chunked prefill off)."""

    def __init__(self, model_name: str, runner: str = "auto", convert: str = "auto",
                 tokenizer_name: str | None = None, tokenizer_mode: str = "auto", trust_remote_code: bool = True,
                 seed: int = 0, max_model_len: int | None = 1024, dtype: str = "auto",
                 disable_log_stats: bool = True, tensor_parallel_size: int = 1, block_size: int = 16,
                 enable_chunked_prefill: bool | None = False, enforce_eager: bool | None = False,
                 **kwargs: Any) -> None:  # fmt: skip
        del model_name, tokenizer_name, tokenizer_mode, trust_remote_code  # the served model's own
        for name in _DROPPED:
            kwargs.pop(name, None)
        _translate_vllm_kwargs(kwargs)
        if runner != "auto":
            kwargs["runner"] = runner
        if convert != "auto":
            kwargs["convert"] = convert
        self.llm = LLM(os.environ.get("TOKENLOOM_PEER_MODEL") or None, seed=seed, max_model_len=max_model_len,
                       dtype=dtype, disable_log_stats=disable_log_stats, tensor_parallel_size=tensor_parallel_size,
                       block_size=block_size, enable_chunked_prefill=enable_chunked_prefill,
                       enforce_eager=bool(enforce_eager), **kwargs)

    @staticmethod
    def get_inputs(prompts: list[Any], **multimodal: Any) -> list[dict[str, Any]]:
        if any(v is not None for v in multimodal.values()):
            pytest.skip("multimodal inputs: tokenloom serves text models")
        inputs = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                inputs.append(dict(prompt))
            elif isinstance(prompt, str):
                inputs.append({"prompt": prompt})
            else:
                inputs.append({"prompt_token_ids": list(prompt)})
        return inputs

    def generate(self, prompts: list[Any], sampling_params: SamplingParams, images: Any = None, videos: Any = None,
                 audios: Any = None, return_logprobs: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        inputs = self.get_inputs(prompts, images=images, videos=videos, audios=audios)
        req_outputs = self.llm.generate(inputs, sampling_params=sampling_params, **kwargs)
        outputs, logprobs = [], []
        for req_output in req_outputs:
            prompt_str, prompt_ids = req_output.prompt, req_output.prompt_token_ids
            ids, strs, req_logprobs = [], [], []
            if req_output.prompt_logprobs:
                req_logprobs.extend(req_output.prompt_logprobs)
            for sample in req_output.outputs:
                ids.append(prompt_ids + list(sample.token_ids))
                strs.append((prompt_str or "") + sample.text)
                if sample.logprobs:
                    req_logprobs.extend(sample.logprobs)
            outputs.append((ids, strs))
            logprobs.append(req_logprobs)
        return outputs if not return_logprobs else (outputs, logprobs)

    @staticmethod
    def _final_steps_generate_w_logprobs(req_outputs: list[Any], include_prompt_token_ids: bool = False) -> list:
        outputs: list[tuple] = []
        for req_output in req_outputs:
            assert len(req_output.outputs) > 0
            for sample in req_output.outputs:  # vLLM's: the last sample's figures per request
                output_str, output_ids, output_logprobs = sample.text, list(sample.token_ids), sample.logprobs
            if include_prompt_token_ids:
                outputs.append((output_ids, output_str, output_logprobs, req_output.prompt_token_ids,
                                req_output.prompt_logprobs))
            else:
                outputs.append((output_ids, output_str, output_logprobs, req_output.prompt_logprobs))
        return outputs

    def generate_w_logprobs(self, prompts: list[str], sampling_params: SamplingParams, images: Any = None,
                            audios: Any = None, videos: Any = None, include_prompt_token_ids: bool = False,
                            **kwargs: Any) -> list:  # fmt: skip
        inputs = self.get_inputs(prompts, images=images, videos=videos, audios=audios)
        req_outputs = self.llm.generate(inputs, sampling_params=sampling_params, **kwargs)
        outputs = self._final_steps_generate_w_logprobs(req_outputs, include_prompt_token_ids)
        # Without prompt logprobs asked for, the last element (None) is left off, as vLLM's does.
        return [x[0:-1] for x in outputs] if sampling_params.prompt_logprobs is None else outputs

    def generate_greedy(self, prompts: list[Any], max_tokens: int, images: Any = None, videos: Any = None,
                        audios: Any = None, **kwargs: Any) -> list[tuple[list[int], str]]:  # fmt: skip
        outputs = self.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), images=images,
                                videos=videos, audios=audios, **kwargs)
        return [(output_ids[0], output_str[0]) for output_ids, output_str in outputs]

    def generate_greedy_logprobs(self, prompts: list[str], max_tokens: int, num_logprobs: int | None,
                                 num_prompt_logprobs: int | None = None, images: Any = None, audios: Any = None,
                                 videos: Any = None, stop_token_ids: list[int] | None = None,
                                 stop: list[str] | None = None, **kwargs: Any) -> list:  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=num_logprobs,
                                prompt_logprobs=num_prompt_logprobs, stop_token_ids=stop_token_ids, stop=stop)
        return self.generate_w_logprobs(prompts, params, images=images, audios=audios, videos=videos, **kwargs)

    def generate_beam_search(self, prompts: list[str], beam_width: int, max_tokens: int, images: Any = None,
                             videos: Any = None, audios: Any = None,
                             concurrency_limit: int | None = None) -> list[tuple[list[list[int]], list[str]]]:
        inputs = self.get_inputs(prompts, images=images, videos=videos, audios=audios)
        outputs = self.llm.beam_search(inputs, BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens),
                                       concurrency_limit=concurrency_limit)
        return [([x.tokens for x in o.sequences], [x.text for x in o.sequences]) for o in outputs]

    def get_llm(self) -> LLM:
        return self.llm

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.llm.shutdown()
        del self.llm


class AutoTokenizer:
    """transformers' AutoTokenizer as the vendored tests call it, for the served model whatever name they give
    (theirs are on the Hub): the same tokenizer the engine runs, loaded by transformers so that its keyword
    arguments (add_prefix_space, ...) apply as they would to the named model's."""

    @staticmethod
    def from_pretrained(model_name: str, **kwargs: Any) -> Any:
        del model_name  # the served model's own, as for vllm_runner
        from transformers import AutoTokenizer as _AutoTokenizer

        from tokenloom.model.paths import default_cache_dir, resolve_model_path
        from tokenloom.model.tokenizer import _gguf_cache_entry, load_tokenizer

        path = resolve_model_path(os.environ.get("TOKENLOOM_PEER_MODEL") or None)
        if path.is_file():  # a GGUF: its tokenizer as tokenloom converted and cached it (done here if not yet)
            load_tokenizer(path)
            path = _gguf_cache_entry(path, default_cache_dir())
        return _AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)


class HfRunner:
    """vLLM's tests/conftest.py HfRunner, the part its sampler tests call (generate, generate_beam_search), over
    transformers' own GGUF loader of the served model (tests/conftest.py's `transformers_default_model`, float32,
    loaded once per run): the HF reference for the default model, which is a GGUF, whatever name a test gives."""

    model: Any = None  # set by the hf_runner fixture

    def __init__(self, model_name: str, dtype: str = "auto", **kwargs: Any) -> None:
        del model_name, dtype, kwargs  # the served model, as transformers loads the GGUF (float32)
        self.tokenizer = AutoTokenizer.from_pretrained("")

    def generate(self, prompts: list[str], **kwargs: Any) -> list[tuple[list[list[int]], list[str]]]:
        import torch

        outputs = []
        for prompt in prompts:
            inputs = self.tokenizer(prompt, return_tensors="pt")
            with torch.inference_mode():
                output_ids = self.model.generate(**inputs, use_cache=True, **kwargs)
            output_str = self.tokenizer.batch_decode(output_ids, skip_special_tokens=True,
                                                     clean_up_tokenization_spaces=False)
            outputs.append((output_ids.cpu().tolist(), output_str))
        return outputs

    def generate_beam_search(self, prompts: list[str], beam_width: int,
                             max_tokens: int) -> list[tuple[list[list[int]], list[str]]]:
        outputs = self.generate(prompts, do_sample=False, max_new_tokens=max_tokens, num_beams=beam_width,
                                num_return_sequences=beam_width)
        for i, (output_ids, output_str) in enumerate(outputs):  # vLLM's: pad tokens dropped
            outputs[i] = ([[x for x in ids if x != self.tokenizer.pad_token_id] for ids in output_ids], output_str)
        return outputs

    def __enter__(self) -> HfRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture(scope="session")
def hf_runner(transformers_default_model: Any) -> type[HfRunner]:
    HfRunner.model = transformers_default_model
    return HfRunner


@pytest.fixture(scope="session")
def vllm_runner() -> type[VllmRunner]:
    return VllmRunner


@pytest.fixture
def example_prompts() -> list[str]:
    return PROMPTS_FILE.read_text().splitlines(keepends=True)  # vLLM's readlines(): each keeps its newline


@pytest.fixture
def sample_json_schema() -> dict[str, Any]:  # vLLM 0.32.0's tests/conftest.py fixture, unchanged
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {
                "type": "array",
                "items": {
                    "type": "string",
                },
            },
            "grade": {
                "type": "string",
                "pattern": "^[A-D]$",
            },
            "email": {
                "type": "string",
                "pattern": "^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}$",
            },
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "company": {"type": "string"},
                        "duration": {
                            "type": "number",
                            "minimum": 0.0,
                            "maximum": 100.0,
                        },
                        "position": {"type": "string"},
                    },
                    "required": ["company", "duration", "position"],
                    "additionalProperties": False,
                },
                "minItems": 0,
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "skills", "grade", "email", "work_history"],
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 10,
    }
