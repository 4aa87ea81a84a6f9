"""tests/peer/openai: vLLM 0.32.0's OpenAI-server tests for text generation (tests/entrypoints/openai) against
`tokenloom serve` of the default model; vllm_shim.py is the plumbing. What is vendored, what is not and why:
docs/conformance.md, "vLLM's OpenAI-server tests".

The files whose server flags agree share one server (vllm_shim.SHARED_FLAGS), started on first use and stopped at
the session's end; the files that need a server of their own run under `make test-peer` (TOKENLOOM_PEER_FULL=1)
only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.peer.openai import vllm_shim

_HERE = Path(__file__).parent

# Each starts a server of its own (its flags differ from the shared one's): full run only.
_FULL_RUN_ONLY_FILES = {
    "test_vllm_chat_echo.py",  # --max-logprobs 151936
    "test_vllm_enable_force_include_usage.py",  # --enable-force-include-usage
    "test_vllm_token_in_token_out.py",  # --skip-tokenizer-init
    "test_vllm_return_tokens_as_ids.py",  # --return-tokens-as-token-ids (and a second without)
    "test_vllm_root_path.py",  # VLLM_API_KEY in the server's environment
    "test_vllm_chunked_prompt.py",  # --enable-chunked-prefill --max-num-batched-tokens 1000
}

# Cases that drive vLLM's request objects' internals (to_sampling_params, build_chat_params, vllm.envs), which
# tokenloom's request models do not have: tokenloom builds SamplingParams in tokenloom/server/params.py.
_VLLM_INTERNALS = "vLLM's request internals (to_sampling_params / build_chat_params / vllm.envs): no counterpart"
_SKIPPED: dict[str, str] = {
    **{f"test_vllm_chat.py::{name}": _VLLM_INTERNALS for name in (
        "test_chat_completion_request_n_parameter_to_sampling_params",
        "test_chat_completion_request_n_parameter_default",
        "test_chat_completion_request_accepts_model_specific_reasoning_effort",
        "test_chat_completion_request_n_parameter_various_values",
        "test_chat_completion_request_n_parameter_exceeds_default_limit",
        "test_chat_completion_request_n_parameter_at_limit",
        "test_chat_completion_request_n_parameter_custom_limit",
        "test_chat_completion_request_n_parameter_massive_value",
    )},
    "test_vllm_completion.py::test_completion_request_bad_words_to_sampling_params": _VLLM_INTERNALS,
    "test_vllm_completion.py::test_completion_request_bad_words_default_empty": _VLLM_INTERNALS,
    "test_vllm_completion.py::test_completion_request_forwards_routed_experts_prompt_start": _VLLM_INTERNALS,
    "test_vllm_logprob_token_ids.py::test_chat_request_decouples_top_k_from_explicit_token_ids": _VLLM_INTERNALS,
    "test_vllm_logprob_token_ids.py::test_completion_request_decouples_top_k_from_explicit_token_ids":
        _VLLM_INTERNALS,
}

# Cases whose assertion holds for vLLM's CI model and not for SmolLM2-135M-Instruct (its texts, its chat template's
# token counts, what it chooses), or that check where tokenloom runs a check rather than what the server answers:
# xfail, strict where the outcome is deterministic (greedy or seeded); (reason, strict).
_SMOLLM2 = "SmolLM2-135M-Instruct's output, not vLLM's CI model's: "
_XFAIL: dict[str, tuple[str, bool]] = {
    "test_vllm_chat.py::test_more_than_one_prompt_logprobs_chat": (
        _SMOLLM2 + "zephyr's 4th prompt token is its own top-1 (one entry); SmolLM2's is not (two)", True),
    "test_vllm_chat.py::test_single_chat_session": (_SMOLLM2 + "37 prompt tokens is zephyr's chat template", True),
    "test_vllm_chat.py::test_structured_outputs_choice_chat": (
        _SMOLLM2 + "asked to pick another language, it often picks the same one (temperature 0.7, no seed)", False),
    "test_vllm_chat.py::test_structured_outputs_json_chat": (
        _SMOLLM2 + "its JSON object runs past max_completion_tokens (1000), cut off", True),
    "test_vllm_chat.py::test_response_format_json_object": (
        _SMOLLM2 + "it does not answer {\"result\": 2} (temperature 1)", False),
    "test_vllm_chat.py::test_response_format_json_schema": (
        _SMOLLM2 + "it answers {} (valid: the schema requires nothing) rather than {\"result\": 2}", False),
    "test_vllm_chat.py::test_complex_message_content": (_SMOLLM2 + "it explains 1+1 rather than answering 2", False),
    "test_vllm_chat.py::test_null_top_logprobs_is_same_as_omitted": (
        "tokenloom's request model leaves top_logprobs None when omitted or null (vLLM's: 0); the server answers "
        "both as vLLM does (no top_logprobs)", True),
    "test_vllm_completion.py::test_single_completion": (
        _SMOLLM2 + "6 prompt tokens is opt-125m's (its BOS); SmolLM2's tokenizer gives 5", True),
    "test_vllm_completion.py::test_completion_streaming": (
        _SMOLLM2 + "greedy, it ends 'What is an LLM?' at once (finish_reason stop, not length)", True),
    "test_vllm_completion.py::test_parallel_no_streaming": (
        _SMOLLM2 + "seeded, two of its three samples end at once (the same empty text)", True),
    "test_vllm_completion.py::test_parallel_streaming": (
        _SMOLLM2 + "seeded, two of its three samples end at once (the same empty text)", True),
    "test_vllm_logprob_token_ids.py::test_completion_rejects_explicit_token_ids_without_generated_tokens": (
        "tokenloom runs this check when it builds the request's params, not in its request model: the server's "
        "answer is the same 400 in vLLM's words (tests/test_server_api.py)", True),
    "test_vllm_logprob_token_ids.py::test_requests_reject_explicit_token_ids_with_beam_search": (
        "tokenloom runs this check when it builds the request's params, not in its request model: the server's "
        "answer is the same 400 in vLLM's words (tests/test_server_api.py)", True),
    "test_vllm_non_object_body_validation.py::test_chat_completion_request_cache_salt_still_validated_on_dict": (
        "tokenloom has no cache_salt: the server refuses any (a 400 naming cache_salt), not in the request model",
        True),
    "test_vllm_return_token_ids.py::test_chat_completion_with_tool_use": (
        _SMOLLM2 + "it answers about Paris's weather rather than calling get_weather (greedy)", True),
    "test_vllm_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs": (
        _SMOLLM2 + "greedy, it ends the prompt at once: its text is '' (echo with return_token_ids adds no prompt "
        "text, as vLLM's), which does not end with '<|im_end|>'", True),
}

# The cases of the shared server's files that `make test` leaves to `make test-peer`, to keep the directory's share
# of the suite near 25 s of worker time: those taking 0.4 s or more on 2 cores, and those sampling with no token
# limit (SmolLM2 may ramble to the model's length: test_response_format_json_schema once took 210 s). What they
# found that tokenloom fixed is in tests/test_server_api.py and tests/test_skip_tokenizer_init.py.
_FULL_RUN_ONLY_CASES = {
    *(f"test_vllm_chat.py::{name}" for name in (
        "test_structured_outputs_json_chat",  # 12 s: 1000 tokens of JSON
        "test_response_format_json_schema", "test_response_format_json_object", "test_complex_message_content",
        "test_custom_role", "test_prompt_logprobs_chat", "test_more_than_one_prompt_logprobs_chat",
        "test_structured_outputs_choice_chat", "test_structured_outputs_regex_chat", "test_no_logprobs_chat",
        "test_chat_completion_n_parameter_non_streaming", "test_chat_completion_stream_options",
        "test_response_format_text", "test_zero_logprobs_chat", "test_structured_outputs_choice_chat_logprobs",
    )),
    *(f"test_vllm_completion.py::{name}" for name in (
        "test_echo_logprob_completion", "test_batch_completions", "test_parallel_streaming",
        "test_parallel_no_streaming",
    )),
    *(f"test_vllm_return_token_ids.py::{name}" for name in (
        "test_chat_completion_with_tool_use", "test_chat_completion_with_emoji_and_token_ids",
        "test_basic_completion_with_emoji", "test_comparison_with_prompt_logprobs_and_logprobs",
    )),
    "test_vllm_chat_completion.py::test_kv_transfer_prompt_token_ids_streaming",
    "test_vllm_chat_completion.py::test_kv_transfer_prompt_token_ids_round_trip",
}

# Parametrizations naming a LoRA adapter downloaded from the Hub (typeof/zephyr-7b-beta-lora, the Qwen3 one):
# out of reach here; tokenloom's LoRA serving is tests/test_server_lora.py's.
_LORA_NAMES = ("zephyr-lora", "qwen3-lora")
_LORA_CASES = {"test_vllm_models.py::test_check_models"}  # /v1/models listing the adapter


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full = bool(os.environ.get("TOKENLOOM_PEER_FULL"))
    long_skip = pytest.mark.skip(reason="starts a server of its own: run by `make test-peer` (TOKENLOOM_PEER_FULL=1)")
    for item in items:
        if item.path.parent != _HERE:  # this hook sees the whole session's items
            continue
        name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if name in _SKIPPED:
            item.add_marker(pytest.mark.skip(reason=_SKIPPED[name]))
        elif any(lora in item.name for lora in _LORA_NAMES) or name in _LORA_CASES:
            item.add_marker(pytest.mark.skip(reason="a LoRA adapter from the Hub (out of reach)"))
        elif not full and (item.path.name in _FULL_RUN_ONLY_FILES or name in _FULL_RUN_ONLY_CASES):
            item.add_marker(long_skip)
        elif name in _XFAIL:
            reason, strict = _XFAIL[name]
            item.add_marker(pytest.mark.xfail(reason=reason, strict=strict))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's (no global clean-up after the test)")


@pytest.fixture(scope="package", autouse=True)
def _servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Where the shared servers log; they stop after this directory's last test in the worker. Not at the
    session's end: every later test's leak check polls each live server (tests/leak_check.py, two requests,
    ~0.15 s a test on a busy core), which made the rest of a worker's ~1,500 tests ~4 minutes slower."""
    vllm_shim.LOG_DIR = tmp_path_factory.mktemp("openai-servers")
    yield
    vllm_shim.stop_all()


@pytest.fixture
def anyio_backend() -> str:  # vLLM's async cases run on anyio's plugin (pytest-asyncio's marker is anyio's here)
    return "asyncio"


# vLLM 0.32.0's tests/entrypoints/conftest.py fixtures the vendored files use, unchanged.
@pytest.fixture
def sample_regex() -> str:
    return (
        r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}"
        r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
    )


@pytest.fixture
def sample_json_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 3,
            },
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "company": {"type": "string"},
                        "duration": {"type": "number"},
                        "position": {"type": "string"},
                    },
                    "required": ["company", "position"],
                },
            },
        },
        "required": ["name", "age", "skills", "work_history"],
    }


@pytest.fixture
def sample_structured_outputs_choices() -> list[str]:
    return [
        "Python",
        "Java",
        "JavaScript",
        "C++",
        "C#",
        "PHP",
        "TypeScript",
        "Ruby",
        "Swift",
        "Kotlin",
    ]


@pytest.fixture(scope="session")
def qwen3_lora_files() -> str:
    """vLLM's: the Qwen3 LoRA adapter from the Hub (not downloaded: vllm_shim.hf_api)."""
    return vllm_shim.hf_api().snapshot_download(repo_id="charent/self_cognition_Alice")
