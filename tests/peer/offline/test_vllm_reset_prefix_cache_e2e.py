# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Vendored from vLLM 0.32.0's tests/v1/core/test_reset_prefix_cache_e2e.py, unchanged but for the plumbing: the
# imports point at tokenloom, the engine runs the default model (vLLM's is a Hub model), and vLLM's
# compilation_config is dropped (tokenloom runs eagerly and has no such argument). The default model runs
# dequantized (`quantization="none"`), a float model as vLLM's Qwen3-0.6B in float16 is: the test holds the reset's
# preemption and recompute to exact greedy equality, and the GGUF kernels' int8 activation rounding is not
# invariant to a step's batch (a decode row beside a 29-token prefill chunk takes the GEMM tiles, beside a few
# rows the fused decode step): on an AVX2-only CPU the quantized path gives other greedy text for 3 of the 4
# prompts on a second undisturbed run (the long prompt's prefix-cache hit changes the other rows' batches),
# up to 0.44 nats apart; dequantized, every logprob is bit-equal across both runs (docs/vllm_peer.md). With
# VLLM_BATCH_INVARIANT=1 the quantized path passes too: tests/test_batch_invariance.py runs these steps that way.

from tokenloom import EngineArgs, LLMEngine, SamplingParams

PROMPTS = [
    "A robot may not injure a human being ",
    "To be or not to be,",
    "What is the meaning of life?",
    "What does the fox say? " * 20,  # Test long prompt
]


def test_reset_prefix_cache_e2e(monkeypatch):
    # "spawn" is required for test to be deterministic
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine_args = EngineArgs(
        model=None,  # vLLM's: "Qwen/Qwen3-0.6B"
        gpu_memory_utilization=0.2,
        async_scheduling=True,
        max_num_batched_tokens=32,
        max_model_len=2048,
        dtype="float16",
        quantization="none",  # tokenloom: the float model (header)
    )
    engine = LLMEngine.from_engine_args(engine_args)
    sampling_params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
    )

    # No preempt case:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request("ground_truth_" + str(i), prompt, sampling_params)

    ground_truth_results = {}
    while engine.has_unfinished_requests():
        request_outputs = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                ground_truth_results[request_output.request_id] = request_output

    # Preempt case:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request("preempted_" + str(i), prompt, sampling_params)

    step_id = 0
    preempted_results = {}
    while engine.has_unfinished_requests():
        if step_id == 10:
            engine.reset_prefix_cache(reset_running_requests=True)

        request_outputs = engine.step()

        for request_output in request_outputs:
            if request_output.finished:
                preempted_results[request_output.request_id] = request_output
        step_id += 1

    for i in range(len(PROMPTS)):
        assert (
            ground_truth_results["ground_truth_" + str(i)].outputs[0].text
            == preempted_results["preempted_" + str(i)].outputs[0].text
        ), (
            f"ground_truth_results['ground_truth_{i}'].outputs[0].text="
            f"{ground_truth_results['ground_truth_' + str(i)].outputs[0].text} "
            f"preempted_results['preempted_{i}'].outputs[0].text="
            f"{preempted_results['preempted_' + str(i)].outputs[0].text}"
        )

