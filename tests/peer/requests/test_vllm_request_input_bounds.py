# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/test_request_input_bounds.py, unchanged but for the plumbing: the imports point
# at tokenloom (its server's request bodies, tokenloom/server/protocol.py; vLLM's InputProcessor is the stand-in of
# vllm_request_shim.py over tokenloom's), and the stop-string override's subprocess imports tokenloom's
# CompletionRequest. Left out, vLLM-only machinery (docs/vllm_peer.md, "Request level"): the prompt-embeds mask
# cases (tokenloom's models read token ids; prompt embeddings are refused by name), the routed-experts offset
# (an RL debugging output of MoE routing tokenloom does not return) and the DeepSeek V3.2 / V4 chat encoders
# (tokenloom renders chats with the model's own Jinja template).
"""Bounds and alignment checks for request-controlled inputs.

Covers prompt-mask alignment, stop-string caps, bad-words dedup/tokenization
limits, stop-token-id dedup, beam-width/sequence caps, and the DeepSeek
history-scan bound.
"""

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Protocol
from unittest.mock import Mock

import pytest
from pydantic import ValidationError

import tokenloom.envs as envs
from tests.peer.requests.vllm_request_shim import InputProcessor
from tokenloom import SamplingParams
from tokenloom.exceptions import VLLMValidationError
from tokenloom.sampling_params import BeamSearchParams
from tokenloom.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


def _process_inputs_with_max_model_len(
    params: SamplingParams, max_model_len: int = 2048
):
    processor = Mock(spec=InputProcessor)
    processor.tokenizer = None
    processor.generation_config_fields = {}
    processor.renderer = Mock()
    processor.renderer.get_eos_token_id.return_value = None
    processor.vllm_config = Mock()
    processor.model_config = Mock()
    processor.model_config.max_model_len = max_model_len
    prompt = {"type": "token", "prompt_token_ids": [1, 2, 3]}
    return InputProcessor.process_inputs(
        processor, "req", prompt, params, ("generate",)
    )


def test_unset_max_tokens_rejects_oversized_min_tokens():
    """Reject min_tokens that only becomes invalid after max_tokens is filled."""
    params = SamplingParams(max_tokens=None, min_tokens=2147483648)
    with pytest.raises(
        VLLMValidationError,
        match="min_tokens must be less than or equal to max_tokens",
    ):
        _process_inputs_with_max_model_len(params)


def test_unset_max_tokens_accepts_min_tokens_within_filled_max():
    params = SamplingParams(max_tokens=None, min_tokens=10)
    request = _process_inputs_with_max_model_len(params)
    assert request.sampling_params.max_tokens == 2045
    assert request.sampling_params.min_tokens == 10


# --- Stop strings: public requests cap the number of stop strings ---------


class _StopRequest(Protocol):
    stop: str | list[str] | None


def _completion_request(stop: list[str]) -> _StopRequest:
    return CompletionRequest(model="test-model", prompt="hello", stop=stop)


def _chat_request(stop: list[str]) -> _StopRequest:
    return ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "hello"}],
        stop=stop,
    )


def _batch_chat_request(stop: list[str]) -> _StopRequest:
    return BatchChatCompletionRequest(
        model="test-model",
        messages=[[{"role": "user", "content": "hello"}]],
        stop=stop,
    )


def _responses_request(stop: list[str]) -> _StopRequest:
    return ResponsesRequest(model="test-model", input="hello", stop=stop)


REQUEST_BUILDERS: list[Callable[[list[str]], _StopRequest]] = [
    _completion_request,
    _chat_request,
    _batch_chat_request,
    _responses_request,
]


@pytest.mark.parametrize("build_request", REQUEST_BUILDERS)
def test_public_requests_accept_four_stop_strings(
    build_request: Callable[[list[str]], _StopRequest],
):
    stop = ["one", "two", "three", "four"]

    request = build_request(stop)

    assert request.stop == stop


@pytest.mark.parametrize("build_request", REQUEST_BUILDERS)
def test_public_requests_reject_more_than_four_stop_strings(
    build_request: Callable[[list[str]], _StopRequest],
):
    with pytest.raises(ValidationError, match="at most 4"):
        build_request(["one", "two", "three", "four", "five"])


def test_stop_string_limit_can_be_overridden():
    env = os.environ.copy()
    env["VLLM_MAX_STOP_STRINGS"] = "1"
    code = """
from pydantic import ValidationError
from tokenloom.server.protocol import CompletionRequest

try:
    CompletionRequest(
        model="test-model",
        prompt="hello",
        stop=["one", "two"],
    )
except ValidationError as error:
    assert "at most 1" in str(error)
else:
    raise AssertionError("configured stop-string limit was not enforced")
"""

    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --- Stop token ids: duplicates are deduplicated in order ------------------


def test_duplicate_stop_token_ids_are_deduplicated_in_order():
    params = SamplingParams(stop_token_ids=[42, 7, 42, 9, 7])

    assert params.stop_token_ids == [42, 7, 9]
    assert params.all_stop_token_ids == {7, 9, 42}


# --- Bad words: dedup, and the tokenization pass is bounded ----------------


class MockTokenizer:
    max_token_id = 1024

    def __init__(self):
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        return [2] if text.startswith(" ") else [1]


def test_duplicate_bad_words_are_deduplicated_in_order():
    params = SamplingParams(bad_words=["bad", "worse", "bad", "worst"])

    assert params.bad_words == ["bad", "worse", "worst"]


def test_bad_word_tokenization_stops_at_worker_limit():
    params = SamplingParams(bad_words=[f"word-{i}" for i in range(65)])
    tokenizer = MockTokenizer()

    with pytest.raises(VLLMValidationError, match="Too many bad words"):
        params.update_from_tokenizer(tokenizer)

    assert tokenizer.calls == 129


def test_bad_word_tokenization_limit_can_be_overridden(monkeypatch):
    monkeypatch.setenv("VLLM_MAX_NUM_BAD_WORDS", "2")
    params = SamplingParams(bad_words=["bad", "worse"])
    tokenizer = MockTokenizer()

    with pytest.raises(VLLMValidationError, match="The max number is 2"):
        params.update_from_tokenizer(tokenizer)

    assert tokenizer.calls == 3


class EmptyBaseEncodingTokenizer:
    max_token_id = 1024

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [216] if text.startswith(" ") else []


def test_bad_word_rejects_empty_base_tokenization():
    params = SamplingParams(bad_words=["\x16"])

    with pytest.raises(
        VLLMValidationError,
        match="must tokenize to at least one token",
    ) as exc_info:
        params.update_from_tokenizer(EmptyBaseEncodingTokenizer())

    assert exc_info.value.parameter == "bad_words"


class EmptyPrefixedEncodingTokenizer:
    max_token_id = 1024

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [] if text.startswith(" ") else [321]


def test_bad_word_skips_empty_optional_prefixed_tokenization():
    params = SamplingParams(bad_words=["word"])

    params.update_from_tokenizer(EmptyPrefixedEncodingTokenizer())

    assert params.bad_words_token_ids == [[321]]


# --- Beam search: beam width / n honor the sequence cap --------------------


def _set_max_n(monkeypatch: pytest.MonkeyPatch, value: int) -> None:
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", str(value))
    if hasattr(envs.__getattr__, "cache_clear"):
        envs.__getattr__.cache_clear()


def test_direct_beam_width_rejects_values_over_sequence_cap(
    monkeypatch: pytest.MonkeyPatch,
):
    _set_max_n(monkeypatch, 4)

    with pytest.raises(VLLMValidationError, match="beam_width must be at most 4"):
        BeamSearchParams(beam_width=5, max_tokens=1)


def test_chat_beam_conversion_rejects_n_before_stream_state_allocation(
    monkeypatch: pytest.MonkeyPatch,
):
    _set_max_n(monkeypatch, 4)
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "test"}],
        n=5,
        stream=True,
        use_beam_search=True,
        max_tokens=1,
    )

    with pytest.raises(VLLMValidationError, match="beam_width must be at most 4"):
        request.to_beam_search_params(max_tokens=1, default_sampling_params={})


def test_chat_beam_conversion_accepts_n_at_sequence_cap(
    monkeypatch: pytest.MonkeyPatch,
):
    _set_max_n(monkeypatch, 4)
    request = ChatCompletionRequest(
        model="test-model",
        messages=[{"role": "user", "content": "test"}],
        n=4,
        stream=True,
        use_beam_search=True,
        max_tokens=1,
    )

    params = request.to_beam_search_params(max_tokens=1, default_sampling_params={})

    assert params.beam_width == 4
