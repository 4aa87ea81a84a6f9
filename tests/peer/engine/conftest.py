# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# The `dummy_test_vectors` fixture is vLLM 0.32.0's tests/v1/engine/conftest.py, unchanged but for the plumbing: the
# imports (the vendored utils, tokenloom's EngineArgs), the tokenizer (no Hub here: AutoTokenizer below is the stand-in
# of tests/peer/offline/conftest.py, the default model's SmolLM2 tokenizer whatever name is given, loaded once) and
# the engine config's model (the default one: vLLM's vectors carry a config that only its watermark case reads).
"""tests/peer/engine: vLLM 0.32.0's engine-level tests (tests/v1/engine, tests/v1/shutdown, tests/v1/metrics) on
tokenloom's front end and engine processes. vllm_engine_shim.py maps vLLM's engine objects onto tokenloom's; what
is vendored, what is not and why: docs/vllm_peer.md, "Engine level"."""

import functools
import os
from pathlib import Path
from typing import Any

import pytest

from tests.peer.engine.vllm_engine_utils import (
    FULL_STRINGS,
    NUM_PROMPT_LOGPROBS_UNDER_TEST,
    NUM_SAMPLE_LOGPROBS_UNDER_TEST,
    PROMPT_LEN,
    TOKENIZER_NAME,
    DummyOutputProcessorTestVectors,
    generate_dummy_prompt_logprobs_tensors,
    generate_dummy_sample_logprobs,
)
from tests.peer.engine.vllm_shutdown_shim import take_baseline
from tests.peer.offline.conftest import AutoTokenizer as _OfflineAutoTokenizer
from tokenloom.engine.args import EngineArgs

# The vendored cases that start engines (2 to 10 s each on 2 cores), run by `make test-peer` (TOKENLOOM_PEER_FULL=1)
# and skipped by `make test`, which keeps one in-process case of test_vllm_delete.py.
_FULL_RUN_ONLY = {
    "test_vllm_delete.py::test_async_llm_delete",  # an engine process per case (7 to 10 s)
    "test_vllm_delete.py::test_llm_delete",
    "test_vllm_delete.py::test_llm_delete_inprocess[False-None]",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TOKENLOOM_PEER_FULL"):
        return
    skip = pytest.mark.skip(reason="a long vendored case: run by `make test-peer` (TOKENLOOM_PEER_FULL=1)")
    for item in items:
        if item.path.parent != Path(__file__).parent:
            continue
        names = (f"{item.path.name}::{getattr(item, 'originalname', item.name)}", f"{item.path.name}::{item.name}")
        if any(name in _FULL_RUN_ONLY for name in names):
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's (no global clean-up after the test)")
    config.addinivalue_line("markers", "cpu_test: vLLM's (its CPU CI selects these tests)")


@pytest.fixture
def engine_baseline() -> None:
    """What was alive before a shutdown test (engine processes, models), which its memory check leaves out."""
    take_baseline()


@pytest.fixture
def anyio_backend() -> str:  # the vendored async cases run on anyio's plugin (pytest-asyncio's marker is anyio's)
    return "asyncio"


class _Tokenizer:
    """The local tokenizer, loaded once for the session, with its vocabulary read once: vLLM's vector helpers read
    `tokenizer.vocab` for every token they draw, and transformers builds that 49,152-entry dict anew on each read
    (~50 ms: seconds per test on this machine). Everything else is the tokenizer's own."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)


class AutoTokenizer:
    """tests/peer/offline/conftest.py's stand-in (the default model's tokenizer whatever the name), loaded once."""

    @staticmethod
    @functools.cache
    def from_pretrained(model_name: str) -> _Tokenizer:
        return _Tokenizer(_OfflineAutoTokenizer.from_pretrained(model_name))


def _build_test_vectors_no_logprobs() -> DummyOutputProcessorTestVectors:
    """Generate output processor dummy test vectors, without logprobs.

    Returns:
      DummyOutputProcessorTestVectors instance with no logprobs

    """
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_NAME)
    vllm_config = EngineArgs(model=None).create_engine_config()
    # Tokenize prompts under test & create dummy generated tokens
    prompt_tokens = [tokenizer(text).input_ids[:PROMPT_LEN] for text in FULL_STRINGS]
    generation_tokens = [
        tokenizer(text).input_ids[PROMPT_LEN:] for text in FULL_STRINGS
    ]
    # Generate prompt strings
    prompt_strings = [
        tokenizer.decode(prompt_tokens, skip_special_tokens=True)
        for prompt_tokens in prompt_tokens
    ]
    prompt_strings_len = [len(prompt_string) for prompt_string in prompt_strings]
    return DummyOutputProcessorTestVectors(
        tokenizer=tokenizer,
        vllm_config=vllm_config,
        full_tokens=[tokenizer(text).input_ids for text in FULL_STRINGS],
        prompt_tokens=prompt_tokens,
        generation_tokens=generation_tokens,
        prompt_strings=prompt_strings,
        prompt_strings_len=prompt_strings_len,
        generation_strings=[
            text[prompt_len:]
            for text, prompt_len in zip(FULL_STRINGS, prompt_strings_len)
        ],
        prompt_logprobs=[],
        generation_logprobs=[],
    )


@pytest.fixture
def dummy_test_vectors() -> DummyOutputProcessorTestVectors:
    """Generate output processor dummy test vectors, with logprobs.

    Returns:
      DummyOutputProcessorTestVectors instance with logprobs

    """
    # Build dummy test vectors without logprobs
    dtv = _build_test_vectors_no_logprobs()
    # Inject logprobs into dummy test vectors
    # data structure
    dtv.generation_logprobs = [
        generate_dummy_sample_logprobs(
            sampled_tokens_list=tokens_list,
            num_logprobs=NUM_SAMPLE_LOGPROBS_UNDER_TEST,
            tokenizer=dtv.tokenizer,
        )
        for tokens_list in dtv.generation_tokens
    ]
    dtv.prompt_logprobs = [
        generate_dummy_prompt_logprobs_tensors(
            prompt_tokens_list=tokens_list,
            num_logprobs=NUM_PROMPT_LOGPROBS_UNDER_TEST,
            tokenizer=dtv.tokenizer,
        )
        for tokens_list in dtv.prompt_tokens
    ]
    return dtv
