"""A quantized GGUF keeps its weights quantized by default (`--quantization` unset = auto), as vLLM and
llama.cpp run a GGUF; `--quantization none` keeps the dequantizing path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_hf_model, write_gguf_from_hf
from tokenloom.config import ConfigError, EngineConfig
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.model.loader import resolve_model_path, resolve_quantization
from tokenloom.sampling_params import SamplingParams

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_kernels = pytest.mark.skipif(gguf_kernels() is None, reason="the GGUF kernels did not build here")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("auto_quant")
    hf_dir = make_tiny_hf_model(tmp / "hf", arch="qwen2", seed=7)
    return {"hf": hf_dir, "q8_0": write_gguf_from_hf(hf_dir, tmp / "q8.gguf", qtype="Q8_0"),
            "f32": write_gguf_from_hf(hf_dir, tmp / "f32.gguf", qtype="F32")}


@needs_kernels
def test_auto_keeps_a_quantized_gguf_quantized_on_cpu(tiny_files: dict[str, Path]) -> None:
    assert resolve_quantization(None, tiny_files["q8_0"], CPU) == "gguf"
    assert resolve_quantization(None, resolve_model_path(None), CPU) == "gguf"  # the default model's Q4_1


def test_auto_runs_float_files_devices_and_directories_in_the_run_dtype(tiny_files: dict[str, Path]) -> None:
    assert resolve_quantization(None, tiny_files["f32"], CPU) is None  # nothing quantized to keep
    assert resolve_quantization(None, tiny_files["hf"], CPU) is None
    assert resolve_quantization(None, tiny_files["q8_0"], CUDA) is None


def test_explicit_choices_win(tiny_files: dict[str, Path]) -> None:
    assert resolve_quantization("none", tiny_files["q8_0"], CPU) is None
    assert resolve_quantization("int8", tiny_files["q8_0"], CPU) == "int8"
    assert resolve_quantization("gguf", tiny_files["q8_0"], CPU) == "gguf"
    with pytest.raises(ConfigError, match="quantization must be one of int8, gguf, none"):
        EngineConfig(quantization="q4")
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(quantization="gguf", device="cuda")
    EngineConfig(quantization="none", device="cuda")  # no method: fine anywhere


@needs_kernels
def test_engine_defaults_and_opt_out(tiny_files: dict[str, Path]) -> None:
    """The engine reports the method in force; both paths generate, and agree on a tiny Q8_0 model."""
    from tokenloom.model.gguf_weights import GGUFLinear

    outs = {}
    for requested, in_force in ((None, "gguf"), ("none", None)):
        engine = LLMEngine(EngineConfig(model=str(tiny_files["q8_0"]), quantization=requested, dtype="float32",
                                        max_model_len=64))
        assert engine.config.quantization == in_force
        layer = engine.runner.model.layers[0].self_attn.qkv_proj
        assert isinstance(getattr(layer, "gguf", None), GGUFLinear) == (in_force == "gguf")
        engine.add_request("r", {"prompt_token_ids": list(range(3, 19))},
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[requested] = out.outputs[0].token_ids
    assert len(outs[None]) == 4 and outs[None][:2] == outs["none"][:2], outs


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "none"])
def test_a_bf16_run_keeps_the_heads_fp32_logits(tiny_files: dict[str, Path], quantization: str | None) -> None:
    """The GGUF head (and the bf16-head kernel) sum in fp32: the greedy path's logits (`fp32=False`) are
    those same fp32 values, not a bf16 rounding of them, so a greedy request picks the token the sampler's
    fp32 path (a request with logprobs) picks, also at near-ties that bf16 would tie or swap."""
    engine = LLMEngine(EngineConfig(model=str(tiny_files["q8_0"]), quantization=quantization, dtype="bfloat16",
                                    max_model_len=64))
    model = engine.runner.model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    fast, full = model.compute_logits(hidden, fp32=False), model.compute_logits(hidden)
    assert full.dtype == torch.float32 and torch.equal(fast.float(), full)
    if quantization is None or model.head_kernels is not None:  # the head summed in fp32 and kept it
        assert fast.dtype == torch.float32
        assert not torch.equal(full, full.bfloat16().float())  # more than bf16's 8 bits survive
    assert torch.equal(model.kernels.argmax_rows(fast), full.argmax(dim=-1))


@needs_kernels
@pytest.mark.parametrize("override, stages", [("none", 0), ("two-stage", 2)])
def test_the_engine_applies_its_planned_weight_prefetch(tiny_files: dict[str, Path], monkeypatch, override: str,
                                                        stages: int) -> None:
    """The plan's prefetch choice (by CPU vendor, or TOKENLOOM_GGUF_PREFETCH) is what the kernels run."""
    kernels = gguf_kernels()
    before = kernels.weight_prefetch_stages()
    monkeypatch.setenv("TOKENLOOM_GGUF_PREFETCH", override)
    try:
        kernels.set_weight_prefetch_stages(1)  # another setting, so that only the engine can set it
        engine = LLMEngine(EngineConfig(model=str(tiny_files["q8_0"]), dtype="float32", max_model_len=64))
        assert engine.runner.model.plan.gguf_prefetch_stages == stages
        assert kernels.weight_prefetch_stages() == stages
    finally:
        kernels.set_weight_prefetch_stages(before)


@pytest.mark.slow
@needs_kernels
def test_default_model_keeps_its_blocks_and_answers() -> None:
    """`LLM()` on the shipped Q4_1 file: weights about the file's size in memory (the dequantized float32
    model is ~4x), and a sensible greedy answer."""
    from tokenloom.engine.llm import LLM

    llm = LLM(max_model_len=512)
    engine = llm.llm_engine
    assert engine.config.quantization == "gguf"
    file_bytes = resolve_model_path(None).stat().st_size
    assert engine.runner.model.weight_bytes() <= 1.1 * file_bytes, (engine.runner.model.weight_bytes(), file_bytes)
    out = llm.chat([{"role": "user", "content": "What is the capital city of Germany?"}],
                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert "Berlin" in out, out


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("engine_kwargs", [
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["async", "ngram"])
def test_default_path_combines_with_structured_outputs(engine_kwargs: dict) -> None:
    """The quantized default under async scheduling and under n-gram drafts, a JSON-schema request
    batched with a free one: the constrained output parses and follows the schema, drafts (when on)
    are accepted, no KV block is left behind."""
    import json

    from tokenloom.engine.llm import LLM
    from tokenloom.sampling_params import StructuredOutputsParams

    llm = LLM(max_model_len=512, **engine_kwargs)
    engine = llm.llm_engine
    assert engine.config.quantization == "gguf"
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(["Is water wet? Answer as JSON:", "Repeat: the cat sat on the mat, the cat sat on the mat,"],
                        params, use_tqdm=False)
    assert isinstance(json.loads(outs[0].outputs[0].text)["answer"], bool), outs[0].outputs[0].text
    assert len(outs[1].outputs[0].token_ids) == 24
    if "speculative_config" in engine_kwargs:
        assert engine.scheduler.make_stats().spec_decoding.num_accepted_tokens > 0
    engine.engine_core.drain()
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    engine.close()


@pytest.mark.slow
@needs_kernels
def test_default_path_under_data_parallel_gives_one_engines_tokens() -> None:
    """Two engine processes on the quantized default, one request each (each engine its own GGUF kernels
    and share of the cores, so its own thread count for the GEMVs' work stealing), give the greedy tokens
    the single engine gives for each request alone: a row's result does not depend on how many threads
    computed it. (Alone, because on the quantized path it may depend on the rows batched with it: a
    prefill of more rows takes the batched GEMM, which sums in another order.)"""
    from tokenloom.engine.llm import LLM

    prompts = ["Write a short story about a lighthouse keeper who finds a message in a bottle on the shore.",
               "Explain in simple words why the sky looks blue during the day and red at sunset, step by step."]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLM(max_model_len=512)
    try:
        assert one.llm_engine.config.quantization == "gguf"
        want = [list(one.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    finally:
        one.llm_engine.close()
    two = LLM(max_model_len=512, data_parallel_size=2, routing_policy="round_robin")
    try:
        got = [list(o.outputs[0].token_ids) for o in two.generate(prompts, params, use_tqdm=False)]
        assert two.llm_engine.client.client.router.num_routed == [1, 1]
    finally:
        two.shutdown()
    assert got == want
