# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/entrypoints/pooling/basic/test_tiling_engine.py, unchanged but for the
# plumbing: the imports point at tokenloom; `vllm_runner` builds a tokenloom.LLM of multilingual-e5-small's local
# stand-in (tests/peer/pooling/standins.py: the Hub is out of reach). tokenloom's LLM puts every prompt into the
# engine at once (its scheduler admits max_num_seqs a step), where vLLM's keeps 2 x max_num_seqs in its core at a
# time; the cases check what both do: every prompt answered, in order, and the unfinished ones aborted when a
# step fails. The abort case is marked allow_leaks: its mock replaces abort_request, so the request it would abort
# stays in the engine, which tokenloom's leak check after every test would report.

import weakref
from unittest import mock

import pytest

from tokenloom import PoolingParams

MODEL_NAME = "intfloat/multilingual-e5-small"


@pytest.fixture(scope="module")
def llm(vllm_runner):
    with vllm_runner(
        MODEL_NAME,
        max_model_len=None,
        max_num_seqs=2,  # small to trigger tiling
        tensor_parallel_size=1,
        gpu_memory_utilization=0.75,
        enforce_eager=True,
        seed=0,
        enable_chunked_prefill=None,
    ) as runner:
        # pytest caches yielded fixtures until after teardown, so use a proxy to
        # avoid retaining the LLM while VllmRunner.__exit__ releases ROCm memory.
        yield weakref.proxy(runner.llm)


@pytest.mark.skip_global_cleanup
def test_tiling_engine_basic(llm):
    """Basic test with a small number of prompts (less than max_num_seqs).
    No tiling should be triggered, but the engine still processes correctly.
    """
    prompts = ["Hello", "World"]
    outputs = llm.encode(prompts, pooling_task="embed")
    assert len(outputs) == len(prompts)


@pytest.mark.skip_global_cleanup
def test_tiling_engine_many_requests(llm):
    """Test with a large number of prompts that exceeds max_num_seqs.
    This verifies that _run_tiling_engine correctly chunks requests,
    processes all of them, and returns outputs in the correct order.
    """
    num_prompts = 10
    prompts = [f"Prompt {i}" for i in range(num_prompts)]
    outputs = llm.encode(prompts, pooling_task="embed")
    assert len(outputs) == num_prompts


@pytest.mark.skip_global_cleanup
def test_tiling_engine_with_pooling_params(llm):
    """Test the tiling engine when different PoolingParams are provided.
    The engine must handle a list of params that matches the number of prompts.
    """
    num_prompts = 10
    prompts = [f"Prompt {i}" for i in range(num_prompts)]
    pooling_params = [PoolingParams() for _ in range(num_prompts)]

    outputs = llm.encode(prompts, pooling_params=pooling_params, pooling_task="embed")
    assert len(outputs) == num_prompts

    # Single PoolingParams shared across all prompts
    single_param = PoolingParams()
    outputs = llm.encode(prompts, pooling_params=single_param, pooling_task="embed")
    assert len(outputs) == num_prompts

    # None PoolingParams should fall back to default
    outputs = llm.encode(prompts, pooling_params=None, pooling_task="embed")
    assert len(outputs) == num_prompts


@pytest.mark.allow_leaks  # the test's mock stands in for abort_request: the request it names stays queued
@pytest.mark.skip_global_cleanup
def test_tiling_engine_abort_on_exception(llm):
    """Test that abort_request IS called with the correct arguments when an
    exception occurs inside the engine's step() loop.
    """
    prompts = ["Prompt 0", "Prompt 1", "Prompt 2"]

    # Mock the step method to throw an exception on the second call
    original_step = llm.llm_engine.step
    call_count = 0

    def mocked_step():
        nonlocal call_count
        call_count += 1
        if call_count == 2:
            raise RuntimeError("Simulated engine error")
        return original_step()

    with mock.patch.object(llm.llm_engine, "step", side_effect=mocked_step):
        # We expect an exception to be raised from encode
        with mock.patch.object(llm.llm_engine, "abort_request") as mock_abort:  # noqa: SIM117
            with pytest.raises(RuntimeError, match="Simulated engine error"):
                llm.encode(prompts, pooling_task="embed")

        args, kwargs = mock_abort.call_args
        request_ids = args[0]
        assert isinstance(request_ids, list)
        assert len(request_ids) > 0
