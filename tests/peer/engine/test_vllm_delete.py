# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/shutdown/test_delete.py (2026-12-07), test bodies unchanged. Plumbing: the
# imports (tokenloom's LLM, AsyncLLM, AsyncEngineArgs, SamplingParams; tests/peer/offline/conftest.py's VllmRunner;
# vLLM's test helpers and platform probe from tests/peer/engine/vllm_shutdown_shim.py, where "GPU memory cleared"
# is its CPU counterpart: the engine processes the test started have exited and the models it built are garbage;
# KernelConfig is the dict tokenloom's kernel_config argument takes), pytest-asyncio's marker as anyio's, and
# MODELS: the default model (None) for vLLM's Hub one. tokenloom's LLM runs its engine core in process whatever
# VLLM_ENABLE_V1_MULTIPROCESSING says (its engine processes are for data parallelism and Ray), so test_llm_delete
# checks that the in-process model is freed. The tensor-parallel cases (2 devices) skip: one CPU is one device.
"""Test that we handle a startup Error and shutdown."""

import pytest

from tests.peer.engine.vllm_shutdown_shim import (
    KernelConfig,
    create_new_process_for_each_test,
    current_platform,
    wait_for_gpu_memory_to_clear,
)
from tests.peer.engine.vllm_shutdown_utils import (
    SHUTDOWN_TEST_THRESHOLD_BYTES,
    SHUTDOWN_TEST_TIMEOUT_SEC,
)
from tests.peer.offline.conftest import VllmRunner
from tokenloom import LLM, AsyncEngineArgs, AsyncLLM, SamplingParams
from tokenloom.sampling_params import RequestOutputKind

MODELS = [None]  # vLLM's: "hmellor/tiny-random-LlamaForCausalLM" (the Hub)

pytestmark = pytest.mark.usefixtures("engine_baseline")


@pytest.mark.anyio
@pytest.mark.timeout(SHUTDOWN_TEST_TIMEOUT_SEC)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tensor_parallel_size", [2, 1])
@pytest.mark.parametrize("send_one_request", [False, True])
async def test_async_llm_delete(
    model: str, tensor_parallel_size: int, send_one_request: bool
) -> None:
    """Test that AsyncLLM frees GPU memory upon deletion.
    AsyncLLM always uses an MP client.

    Args:
      model: model under test
      tensor_parallel_size: degree of tensor parallelism
      send_one_request: send one request to engine before deleting

    """
    if current_platform.device_count() < tensor_parallel_size:
        pytest.skip(reason="Not enough CUDA devices")

    engine_args = AsyncEngineArgs(
        model=model,
        enforce_eager=True,
        tensor_parallel_size=tensor_parallel_size,
        kernel_config=KernelConfig(enable_jit_warmup=False),
    )

    # Instantiate AsyncLLM; make request to complete any deferred
    # initialization; then delete instance
    async_llm = AsyncLLM.from_engine_args(engine_args)
    if send_one_request:
        async for _ in async_llm.generate(
            "Hello my name is",
            request_id="abc",
            sampling_params=SamplingParams(
                max_tokens=1, output_kind=RequestOutputKind.DELTA
            ),
        ):
            pass
    del async_llm

    # Confirm all the processes are cleaned up.
    wait_for_gpu_memory_to_clear(
        devices=list(range(tensor_parallel_size)),
        threshold_bytes=SHUTDOWN_TEST_THRESHOLD_BYTES,
    )


@pytest.mark.timeout(SHUTDOWN_TEST_TIMEOUT_SEC)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tensor_parallel_size", [2, 1])
@pytest.mark.parametrize("enable_multiprocessing", [True])
@pytest.mark.parametrize("send_one_request", [False, True])
def test_llm_delete(
    monkeypatch,
    model: str,
    tensor_parallel_size: int,
    enable_multiprocessing: bool,
    send_one_request: bool,
) -> None:
    """Test that LLM frees GPU memory upon deletion.
    TODO(andy) - LLM without multiprocessing.

    Args:
      model: model under test
      tensor_parallel_size: degree of tensor parallelism
      enable_multiprocessing: enable workers in separate process(es)
      send_one_request: send one request to engine before deleting

    """
    if current_platform.device_count() < tensor_parallel_size:
        pytest.skip(reason="Not enough CUDA devices")

    with monkeypatch.context() as m:
        MP_VALUE = "1" if enable_multiprocessing else "0"
        m.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", MP_VALUE)

        # Instantiate LLM; make request to complete any deferred
        # initialization; then delete instance
        llm = LLM(
            model=model,
            enforce_eager=True,
            tensor_parallel_size=tensor_parallel_size,
            kernel_config=KernelConfig(enable_jit_warmup=False),
        )
        if send_one_request:
            llm.generate(
                "Hello my name is", sampling_params=SamplingParams(max_tokens=1)
            )
        del llm

        # Confirm all the processes are cleaned up.
        wait_for_gpu_memory_to_clear(
            devices=list(range(tensor_parallel_size)),
            threshold_bytes=SHUTDOWN_TEST_THRESHOLD_BYTES,
        )


@create_new_process_for_each_test("fork" if current_platform.is_cuda() else "spawn")
@pytest.mark.timeout(SHUTDOWN_TEST_TIMEOUT_SEC)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("send_one_request", [False, True])
def test_llm_delete_inprocess(
    monkeypatch,
    model: str,
    send_one_request: bool,
) -> None:
    """Test that VllmRunner frees GPU memory in in-process (no MP) mode."""
    with monkeypatch.context() as m:
        m.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        with VllmRunner(
            model,
            kernel_config=KernelConfig(enable_jit_warmup=False),
        ) as vllm_model:
            if send_one_request:
                vllm_model.generate(
                    ["Hello my name is"],
                    SamplingParams(max_tokens=1),
                )

        wait_for_gpu_memory_to_clear(
            devices=[0],
            threshold_bytes=SHUTDOWN_TEST_THRESHOLD_BYTES,
            # Activate the helper's ROCm idle-runtime floor. VllmRunner already
            # performed the stable-memory wait during context exit.
            threshold_ratio=0.01 if current_platform.is_rocm() else None,
            # Fail in the child before the outer pytest timeout expires.
            timeout_s=(
                SHUTDOWN_TEST_TIMEOUT_SEC // 2
                if current_platform.is_rocm()
                else SHUTDOWN_TEST_TIMEOUT_SEC
            ),
        )
