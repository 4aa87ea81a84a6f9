# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/e2e/general/test_async_scheduling.py: the test bodies and run_tests /
# run_test as they are but for the plumbing and the parameter grid, cut to what runs on 2 CPU cores in about two
# minutes (docs/vllm_peer.md says which combinations stay): the imports point at tokenloom and at vLLM's helpers
# vendored in tests/peer/offline/vllm_test_utils.py; VllmRunner (tests/peer/offline/conftest.py) runs the default
# model for Qwen3-0.6B, drops the attention backend, and takes vLLM's num_gpu_blocks_override, "uni" executor and
# VLLM_FLOAT32_MATMUL_PRECISION=highest in tokenloom's terms (the last: the dequantized path, whose rows do not
# depend on the batch); single_gpu_only and current_platform are stand-ins (tokenloom runs one rank, on neither
# ROCm nor XPU). Left out, vLLM-only machinery (docs/vllm_peer.md has the
# details): test_with_eagle3_spec_decoding (an EAGLE-3 draft model, refused when the LLM is built) and
# test_with_ngram_gpu_spec_decoding (vLLM's GPU n-gram proposer, refused by name, whose acceptance accounting
# the test compares between sync and async). test_without_spec_decoding is a long case that `make test` skips.
import os
from itertools import repeat
from typing import Any

import pytest
import torch._dynamo.config as dynamo_config

from tests.peer.offline.conftest import VllmRunner
from tests.peer.offline.vllm_test_utils import check_outputs_equal
from tokenloom import SamplingParams
from tokenloom.engine.metrics_reader import Metric
from tokenloom.logprobs import Logprob
from tokenloom.sampling_params import StructuredOutputsParams


def single_gpu_only(test):  # vLLM's tests.utils mark: tokenloom runs one rank
    return test


class current_platform:  # vLLM's vllm.platforms.current_platform: tokenloom runs on neither ROCm nor XPU
    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_xpu() -> bool:
        return False


MODEL = "Qwen/Qwen3-0.6B"
MTP_MODEL = "meta-llama/Llama-3.2-1B-Instruct"

# Need to enforce eager for MRV2 while we sort out cudagraph issues.
ENFORCE_EAGER = os.getenv("ENFORCE_EAGER", "0") == "1"

first_prompt = (
    "The following numbers of the sequence "
    + ", ".join(str(i) for i in range(10))
    + " are:"
)
example_prompts = [first_prompt, "In one word, the capital of France is "] + [
    f"Tell me about the number {i}: " for i in range(32)
]

default_params = dict(
    temperature=0.0,  # greedy
    max_tokens=30,
    min_tokens=28,
)


@single_gpu_only
def test_without_spec_decoding(
    sample_json_schema,
    monkeypatch: pytest.MonkeyPatch,
):
    """Test consistency of combos of async scheduling, preemption,
    uni/multiproc executor, prefill chunking."""
    struct_outputs = StructuredOutputsParams(json=sample_json_schema)
    # tokenloom: 4 of vLLM's 11 parameter sets, which between them cover each kind (penalties, bad words,
    # sample and prompt logprobs, a grammar).
    test_sampling_params: list[dict[str, Any]] = [
        dict(),
        dict(bad_words=["the", " the"]),
        dict(prompt_logprobs=2, logprobs=2),
        dict(
            structured_outputs=struct_outputs,
            logprobs=2,
            frequency_penalty=-1.0,
        ),
    ]

    # test_preemption, executor, async_scheduling,
    # spec_config, test_prefill_chunking
    # tokenloom: 3 of vLLM's 9 (its "mp" and "uni" executors are the same in-process runner here): the sync
    # baseline, sync with preemption and chunking, async with preemption and chunking.
    test_configs = [
        (False, "mp", False, None, False),
        (True, "mp", False, None, True),
        (True, "uni", True, None, True),
    ]

    if current_platform.is_rocm():
        # On ROCm, Only test with structured_outputs (deterministic)
        # and skip chunk_prefill (more variable).
        test_configs = [
            cfg
            for cfg in test_configs
            if not cfg[4]  # skip chunk_prefill=True
        ]
        test_sampling_params = [
            p for p in test_sampling_params if p.get("structured_outputs") is not None
        ]

    run_tests(monkeypatch, MODEL, test_configs, test_sampling_params)


@dynamo_config.patch(cache_size_limit=16)
def run_tests(
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    test_configs: list[tuple],
    test_sampling_params: list[dict[str, Any]],
):
    """Test consistency of combos of async scheduling, preemption,
    uni/multiproc executor with spec decoding."""
    # Flex attention supports float32.
    attention_config = {"backend": "FLEX_ATTENTION"}

    with monkeypatch.context() as m:
        # lock matmul precision to full FP32 (IEEE)
        m.setenv("VLLM_FLOAT32_MATMUL_PRECISION", "highest")
        outputs: list[tuple[str, list, list]] = []
        for n, (
            test_preemption,
            executor,
            async_scheduling,
            spec_config,
            test_prefill_chunking,
        ) in enumerate(test_configs, 1):
            test_str = f"{n}/{len(test_configs)}"
            test_results = run_test(
                model,
                test_str,
                test_sampling_params,
                test_preemption,
                executor,
                async_scheduling,
                spec_config,
                test_prefill_chunking=test_prefill_chunking,
                attention_config=attention_config,
            )
            outputs.append(test_results)

    baseline_config, baseline_tests, _ = outputs[0]
    _, _, baseline_acceptances = next(
        (o for o in outputs if o[2] is not None), (None, None, None)
    )

    print(f"BASELINE: config=[{baseline_config}], accept_rates={baseline_acceptances}")

    failure = None
    for test_config, test_outputs, test_acceptance_rates in outputs[1:]:
        for (base_outs, base_logprobs), base_acceptance_rate, (
            test_outs,
            test_logprobs,
        ), test_acceptance_rate, params in zip(
            baseline_tests,
            baseline_acceptances or repeat(None),
            test_outputs,
            test_acceptance_rates or repeat(None),
            test_sampling_params,
        ):
            reason = None
            try:
                check_outputs_equal(
                    outputs_0_lst=base_outs,
                    outputs_1_lst=test_outs,
                    name_0=f"baseline=[{baseline_config}], params={params}",
                    name_1=f"config=[{test_config}], params={params}",
                )
            except AssertionError as e:
                reason = "outputs ", e

            if reason is None:
                try:
                    assert _all_logprobs_match(base_logprobs, test_logprobs)
                except AssertionError as e:
                    reason = "logprobs", e

            if reason is None:
                try:
                    if (
                        base_acceptance_rate is not None
                        and test_acceptance_rate is not None
                    ):
                        if "spec_mml=None" in test_config:
                            # Preemption causes more variance in acceptance rates
                            if (
                                current_platform.is_rocm()
                                and "preemption=True" in test_config
                            ):
                                tolerance = 0.10
                            else:
                                tolerance = 0.05
                            assert (
                                test_acceptance_rate > base_acceptance_rate
                                or test_acceptance_rate
                                == pytest.approx(base_acceptance_rate, rel=tolerance)
                            )
                        else:
                            # Currently the reported acceptance rate is expected to be
                            # lower when we sometimes skip drafting altogether.
                            assert test_acceptance_rate > 0.1
                except AssertionError as e:
                    reason = "accept  ", e

            if reason is None:
                print(
                    f"\033[32mPASSED\033[0m:           "
                    f"config=[{test_config}], params={params}"
                    f" accept_rate={test_acceptance_rate}"
                )
            else:
                reason_str, _ = reason
                print(
                    f"\033[31mFAILED\033[0m({reason_str}): "
                    f"config=[{test_config}], params={params}"
                    f" accept_rate={test_acceptance_rate}"
                )
                if failure is None:
                    _, failure = reason

    if failure is not None:
        raise failure


def run_test(
    model: str,
    test_str: str,
    sampling_param_tests: list[dict[str, Any]],
    test_preemption: bool,
    executor: str,
    async_scheduling: bool,
    spec_config: dict[str, Any] | None,
    test_prefill_chunking: bool,
    attention_config: dict[str, Any] | None = None,
):
    spec_decoding = spec_config is not None
    cache_arg: dict[str, Any] = (
        # Force preemptions: with 33 blocks (one is the reserved null block)
        # the cache holds at most a single max-length request, so the ~34
        # concurrent prompts contend and trigger preemption. (Prompts here are
        # << max_model_len, so dropping max_model_len from 4096 to 512 doesn't
        # change generation behavior.)
        dict(num_gpu_blocks_override=33, max_model_len=512)
        if test_preemption
        else dict(gpu_memory_utilization=0.9, max_model_len=4096)
    )
    spec_mml = (spec_config or {}).get("max_model_len")
    spec_method = (spec_config or {}).get("method", "none")
    test_config = (
        f"executor={executor}, preemption={test_preemption}, "
        f"async_sched={async_scheduling}, "
        f"chunk_prefill={test_prefill_chunking}, "
        f"spec_decoding={spec_decoding}, spec_method={spec_method}, spec_mml={spec_mml}"
    )
    print("-" * 80)
    print(f"---- TESTING {test_str}: {test_config}")
    print("-" * 80)

    with VllmRunner(
        model,
        enable_chunked_prefill=test_prefill_chunking,
        # Force prefill chunking
        max_num_batched_tokens=48 if test_prefill_chunking else None,
        enforce_eager=ENFORCE_EAGER,
        async_scheduling=async_scheduling,
        distributed_executor_backend=executor,
        dtype="float32",
        speculative_config=spec_config,
        disable_log_stats=False,
        attention_config=attention_config,
        enable_prefix_caching=False if current_platform.is_rocm() else None,
        **cache_arg,
    ) as vllm_model:
        results = []
        acceptance_rates: list[float] | None = [] if spec_decoding else None
        for override_params in sampling_param_tests:
            metrics_before = vllm_model.llm.get_metrics()
            print(f"----------- RUNNING PARAMS: {override_params}")
            results.append(
                vllm_model.generate(
                    example_prompts,
                    sampling_params=SamplingParams(**default_params, **override_params),
                    return_logprobs=True,
                )
            )
            metrics_after = vllm_model.llm.get_metrics()
            if acceptance_rates is not None:
                acceptance_rate = _get_acceptance_rate(metrics_before, metrics_after)
                acceptance_rates.append(acceptance_rate)
                print(f"ACCEPTANCE RATE {acceptance_rate}")

            if test_preemption:
                preemptions = _get_count(
                    metrics_before, metrics_after, "vllm:num_preemptions"
                )
                assert preemptions > 0, "preemption test had no preemptions"

    if len(results) > 1:
        # First check that the different parameter configs
        # actually result in different output.
        for (other_test_outs, other_test_logprobs), params in zip(
            results[1:], sampling_param_tests[1:]
        ):
            with pytest.raises(AssertionError):
                check_outputs_equal(
                    outputs_0_lst=results[0][0],
                    outputs_1_lst=other_test_outs,
                    name_0=f"baseline params={params}",
                    name_1=f"other params={params}",
                )
                assert _all_logprobs_match(results[0][1], other_test_logprobs)

    return test_config, results, acceptance_rates


def _all_logprobs_match(req_a, req_b) -> bool:
    return (
        req_a == req_b
        or len(req_a) == len(req_b)
        and all(
            len(seq_a) == len(seq_b)
            and all(_logprobs_match(a, b) for a, b in zip(seq_a, seq_b))
            for seq_a, seq_b in zip(req_a, req_b)
        )
    )


def _logprobs_match(
    lps_a: dict[int, Logprob] | None,
    lps_b: dict[int, Logprob] | None,
) -> bool:
    if lps_a is None or lps_b is None:
        return lps_a is lps_b
    rel_tol, abs_tol = 1e-3, 1e-6
    return (
        len(lps_a) == len(lps_b)
        and lps_a.keys() == lps_b.keys()
        and all(
            a.decoded_token == b.decoded_token
            and a.rank == pytest.approx(b.rank, rel=0.005)
            and a.logprob == pytest.approx(b.logprob, rel=rel_tol, abs=abs_tol)
            for a, b in ((lps_a[x], lps_b[x]) for x in lps_a)
        )
    )


def _get_acceptance_rate(before: list[Metric], after: list[Metric]) -> float:
    draft = _get_count(before, after, "vllm:spec_decode_num_draft_tokens")
    accept = _get_count(before, after, "vllm:spec_decode_num_accepted_tokens")
    return accept / draft if draft > 0 else 0.0


def _get_count(before: list[Metric], after: list[Metric], name: str) -> int:
    before_val = next(m.value for m in before if m.name == name)
    after_val = next(m.value for m in after if m.name == name)
    return after_val - before_val
