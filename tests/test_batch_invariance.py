"""VLLM_BATCH_INVARIANT=1: a row's numbers do not depend on the step it runs in (docs/reproducibility.md).

vLLM's own determinism tests (tests/v1/determinism/test_batch_invariance.py: a needle alone and in a batch,
ragged chunked prefill, decode logprobs equal to prefill logprobs), held bit for bit on the default model,
whose weights stay quantized (the path that is not invariant without the variable: the needle's greedy text
changes in a batch there), and on a float32 checkpoint; then the combinations (prefix-cache hits, n-gram
speculation, async scheduling) and the refusals of what the mode does not cover.
"""

from __future__ import annotations

import pytest

from tests.pooling_models import make_tiny_bert
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, EngineArgs, LLMEngine, SamplingParams
from tokenloom.config import ConfigError, has_arctic_inference
from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.sampling_params import StructuredOutputsParams

NEEDLE = "There once was a clever fox who"
FILLERS = [("The history of the city begins with a small settlement on the river, where traders met. " * (i + 1))
           for i in range(7)]
LONG = ("A long prompt that the small budget splits into several chunks: " + " ".join(
    f"item {i} is {i * 7 % 13}," for i in range(60)))
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=20240919, max_tokens=24, logprobs=5)


@pytest.fixture(scope="module")
def invariant():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_BATCH_INVARIANT", "1")
        yield mp
    # An in-process engine (the LLMEngine case) set the kernels' process-wide switch; later tests' kernels
    # in this process run as the default engine's do.
    kernels = gguf_kernels()
    if kernels is not None:
        kernels.set_batch_invariant(False)


@pytest.fixture(scope="module")
def llm(invariant):
    engine = LLM(max_num_seqs=16, enable_prefix_caching=True)
    yield engine
    engine.shutdown()


def steps(out) -> tuple[list[int], list[float]]:
    """Tokens and their logprobs, as vLLM's _extract_step_logprobs."""
    o = out.outputs[0]
    return list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_needle_alone_and_in_a_batch(llm, params) -> None:
    alone = steps(llm.generate([NEEDLE], params, use_tqdm=False)[0])
    for pos in (0, 3, 7):
        prompts = FILLERS[:pos] + [NEEDLE] + FILLERS[pos:]
        batched = steps(llm.generate(prompts, params, use_tqdm=False)[pos])
        assert batched == alone, f"needle at {pos} of {len(prompts)}"


def test_prefix_cache_hit_equals_the_cold_run(llm) -> None:
    prompt = LONG + " The last item"
    cold = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    hit = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    assert steps(hit) == steps(cold)  # the first token too: its prompt row ran beside no cached rows


def test_decode_logprobs_equal_prefill_logprobs(llm) -> None:
    """vLLM's test_decode_logprobs_match_prefill_logprobs: each generated token's logprob, scored again as
    a prompt token (prompt_logprobs of prompt + generated), is the same float."""
    out = llm.generate([NEEDLE], GREEDY, use_tqdm=False)[0]
    tokens, decoded = steps(out)
    prompt_ids = list(out.prompt_token_ids)
    again = llm.generate([{"prompt_token_ids": prompt_ids + tokens}],
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    prefilled = [again.prompt_logprobs[len(prompt_ids) + i][t].logprob for i, t in enumerate(tokens)]
    assert prefilled == decoded


def test_chunked_prefill_async_scheduling_and_threads_equal_the_plain_engine(llm, invariant) -> None:
    """A budget that splits the long prompt and the batch's other prefills (vLLM's ragged chunked-prefill
    case) under async scheduling, on three threads: another engine, the same numbers, seeded draws included."""
    prompts = [NEEDLE, LONG, *FILLERS[:4]]
    plain = [steps(o) for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "3")
        other = LLM(max_num_seqs=16, max_num_batched_tokens=48, async_scheduling=True)
    try:
        assert [steps(o) for o in other.generate(prompts, SEEDED, use_tqdm=False)] == plain
    finally:
        other.shutdown()


SPECS = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
         pytest.param({"method": "suffix", "num_speculative_tokens": 4},
                      marks=pytest.mark.skipif(not has_arctic_inference(), reason="suffix decoding needs "
                                               "arctic-inference (`make test` builds it)"))]


@pytest.mark.parametrize("spec", SPECS, ids=["ngram", "suffix"])
def test_speculation_equals_plain_decoding(llm, invariant, spec) -> None:
    """Verification rows are rows like any other: greedy text and logprobs with drafts are those without
    (seeded draws are not compared: rejection sampling draws its randomness otherwise, in vLLM too)."""
    prompts = [NEEDLE, LONG, *FILLERS[:4]]
    plain = [steps(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    other = LLM(max_num_seqs=16, disable_log_stats=False, speculative_config=spec)
    try:
        assert [steps(o) for o in other.generate(prompts, GREEDY, use_tqdm=False)] == plain
        accepted = [m for m in other.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens"]
        assert accepted[0].value > 0  # drafts were verified, and some accepted
    finally:
        other.shutdown()


def test_data_parallel_replicas_equal_one_engine(llm, invariant) -> None:
    """Two replicas (each its own engine process, one core each where there are two): every request's
    numbers are those of the one-engine run, whichever replica served it and whatever ran beside it."""
    prompts = [NEEDLE, *FILLERS[:5]]
    plain = [steps(o) for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
    dp = LLM(max_num_seqs=16, data_parallel_size=2)
    try:
        assert [steps(o) for o in dp.generate(prompts, SEEDED, use_tqdm=False)] == plain
    finally:
        dp.shutdown()


def test_vllms_reset_prefix_cache_e2e_on_the_quantized_path(invariant) -> None:
    """vLLM's tests/v1/core/test_reset_prefix_cache_e2e.py (vendored in tests/peer/offline, where the default
    model runs dequantized since its quantized path is not batch-invariant), on the weights kept quantized: the
    running requests are preempted at step 10 and recomputed, in other steps beside other rows, under async
    scheduling with a 32-token budget, and still give the undisturbed run's text."""
    prompts = ["A robot may not injure a human being ", "To be or not to be,", "What is the meaning of life?",
               "What does the fox say? " * 20]
    engine = LLMEngine.from_engine_args(EngineArgs(model=None, async_scheduling=True, max_num_batched_tokens=32,
                                                   max_model_len=2048))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    texts: dict[str, str] = {}
    try:
        for run in ("ground_truth", "preempted"):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{run}_{i}", prompt, params)
            step = 0
            while engine.has_unfinished_requests():
                if run == "preempted" and step == 10:
                    engine.reset_prefix_cache(reset_running_requests=True)
                texts.update((o.request_id, o.outputs[0].text) for o in engine.step() if o.finished)
                step += 1
    finally:
        engine.close()
    assert [texts[f"preempted_{i}"] for i in range(4)] == [texts[f"ground_truth_{i}"] for i in range(4)]


@pytest.mark.parametrize("kvd", ["int8", "float16"])
def test_int8_and_16bit_kv_caches_and_structured_outputs(invariant, kvd) -> None:
    """The fused decoder writes and reads int8 K/V (a scale per token and head) and 16-bit K/V per row too
    (its query heads grouped by kv head or not, the same arithmetic per head); a JSON schema masks each
    row's logits alone."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    params = [SEEDED, SamplingParams(temperature=0.0, max_tokens=24, logprobs=5,
                                     structured_outputs=StructuredOutputsParams(json=schema))]
    engine = LLM(max_num_seqs=16, kv_cache_dtype=kvd)
    try:
        for sp in params:
            alone = steps(engine.generate([NEEDLE], sp, use_tqdm=False)[0])
            assert steps(engine.generate([FILLERS[5], NEEDLE, LONG], sp, use_tqdm=False)[1]) == alone
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float_checkpoint(invariant, tmp_path, dtype) -> None:
    """The fused decoder's dense kernels and the LM head's dense kernel: float weights are covered too. In
    float32 the rows agree with the default path's (oneDNN's packed GEMMs, the tiled prefill attention) to
    float32 rounding: a prefill chunk's rows run as rows of their own and still attend to what they should."""
    model = make_tiny_hf_model(tmp_path / "tiny", arch="llama", seed=3)
    ids = [{"prompt_token_ids": [(5 * j + k) % 190 + 3 for j in range(9 + 4 * k)]} for k in range(6)]
    engine = LLM(str(model), dtype=dtype, max_num_seqs=8, enable_prefix_caching=True, block_size=4)
    try:
        alone = steps(engine.generate([ids[2]], SEEDED, use_tqdm=False)[0])
        batched = engine.generate(ids, SEEDED, use_tqdm=False)
        assert batched[2].num_cached_tokens > 0  # the prompt's blocks were cached by the first run
        assert steps(batched[2]) == alone
        mine = [steps(o) for o in batched]
    finally:
        engine.shutdown()
    if dtype == "float32":
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_BATCH_INVARIANT", "0")
            default = LLM(str(model), dtype=dtype, max_num_seqs=8, block_size=4)
            try:
                theirs = [steps(o) for o in default.generate(ids, SEEDED, use_tqdm=False)]
            finally:
                default.shutdown()
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        for (_, a), (_, b) in zip(mine, theirs, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_refuses_what_it_does_not_cover(invariant, tmp_path) -> None:
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT=1 does not cover LoRA"):
        LLM(enable_lora=True)
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT=1 does not cover tensor / pipeline parallelism"):
        LLM(tensor_parallel_size=2)
    with pytest.raises(Exception, match="VLLM_BATCH_INVARIANT=1: the fused decoder covers Llama / Qwen2"):
        LLM(str(make_tiny_hf_model(tmp_path / "gemma", arch="gemma2", seed=1)), dtype="float32")
    with pytest.raises(Exception, match="VLLM_BATCH_INVARIANT=1 does not cover encoder-only models"):
        LLM(str(make_tiny_bert(tmp_path / "bert", seed=1)), runner="pooling", dtype="float32")
