"""Multi-LoRA serving (issue 34): PEFT adapters over a tiny random Llama, against transformers + peft.

Adapters are made here with `peft` (random rank-8 A and B: a zero B, peft's init, would test nothing)
and saved as PEFT saves them; each generated token's logprob must equal the unmerged peft model's
within 2e-3, for each adapter alone and for one batch mixing three adapters and the base model.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.leak_check import core_leaks
from tests.tiny_models import make_tiny_hf_model, reference_logprobs
from tokenloom.core.scheduler import RequestRejected
from tokenloom.engine.llm import LLM
from tokenloom.lora.request import LoRARequest
from tokenloom.sampling_params import SamplingParams

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
TOL = 2e-3
QUANT_TOL = 0.05  # logprobs over a quantized base (Q8_0 blocks, int8 W8A8) against the float reference


def make_peft_adapter(base_dir: Path, out: Path, seed: int, targets=ALL_TARGETS, r: int = 8, alpha: int = 16,
                      use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of `base_dir` with random (non-zero) A and B, saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  lora_dropout=0.0, use_rslora=use_rslora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1, generator=gen)
    peft_model.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=4)
def _peft_model(base_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_logprobs(base_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the unmerged peft model's logits (the base model's for adapter_dir None)."""
    if adapter_dir is None:
        return reference_logprobs(base_dir, token_ids)
    model = _peft_model(str(base_dir), str(adapter_dir))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_peft(base_dir: Path, adapter_dir: Path | None, out) -> None:
    comp = out.outputs[0]
    ref = peft_logprobs(base_dir, adapter_dir, out.prompt_token_ids + comp.token_ids[:-1])
    n = len(out.prompt_token_ids)
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        want = ref[n - 1 + i]
        assert int(want.argmax()) == tok, (adapter_dir, i)
        assert lp[tok].logprob == pytest.approx(want[tok].item(), abs=TOL), (adapter_dir, i)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [
        make_peft_adapter(base_dir, root / "all", seed=11),
        make_peft_adapter(base_dir, root / "attn", seed=12, targets=("q_proj", "v_proj")),
        make_peft_adapter(base_dir, root / "mlp-rs", seed=13, targets=("gate_proj", "up_proj", "down_proj", "o_proj"),
                          alpha=8, use_rslora=True),
    ]


def lora(i: int, path: Path) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, str(path))


@pytest.fixture(scope="module")
def llm(base_dir):
    engine = LLM(str(base_dir), dtype="float32", num_blocks=256, block_size=4, enable_lora=True, max_loras=3,
                 max_lora_rank=8)
    yield engine


PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * j) % 300 + 3 for j in range(9 + 2 * i)]} for i in range(4)]


def test_each_adapter_alone_matches_peft(llm, base_dir, adapters) -> None:
    for i, path in enumerate(adapters, start=1):
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora(i, path))[0]
        assert_matches_peft(base_dir, path, out)
    # The adapters change the outputs (their B is not zero).
    base = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tuned = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora(1, adapters[0]))[0]
    assert tuned.outputs[0].token_ids != base


def test_one_batch_mixes_three_adapters_and_the_base(llm, base_dir, adapters) -> None:
    loras = [lora(1, adapters[0]), None, lora(2, adapters[1]), lora(3, adapters[2])]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    for out, req in zip(outs, loras):
        assert_matches_peft(base_dir, Path(req.lora_path) if req else None, out)
    assert core_leaks(llm.llm_engine.engine_core) == []  # no block, request or runner state left behind


def test_merged_weights_give_the_same_tokens(llm, base_dir, adapters, tmp_path) -> None:
    """peft's merge_and_unload folds the adapter into the base weights: tokenloom over the merged model
    and tokenloom over base + adapter generate the same tokens."""
    merged_dir = tmp_path / "merged"
    _peft_model(str(base_dir), str(adapters[0])).merge_and_unload().save_pretrained(merged_dir)
    for f in base_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, merged_dir / f.name)
    _peft_model.cache_clear()  # merge_and_unload changed the cached model's base weights
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    merged = LLM(str(merged_dir), dtype="float32", num_blocks=64, block_size=4)
    want = [o.outputs[0].token_ids for o in merged.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False,
                                                          lora_request=lora(1, adapters[0]))]
    assert got == want


def test_prefix_cache_never_shares_kv_across_adapters(llm, base_dir, adapters) -> None:
    """Blocks are keyed by the adapter (vLLM's LoRA extra hash key): the same prompt under another
    adapter, or the base model, hits nothing; under the same adapter it hits; outputs stay exact."""
    prompt = {"prompt_token_ids": [(11 * j) % 290 + 7 for j in range(21)]}  # 5 full blocks of 4
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora(1, adapters[0]))[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora(1, adapters[0]))[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora(2, adapters[1]))[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert_matches_peft(base_dir, adapters[0], again)
    assert_matches_peft(base_dir, adapters[1], other)
    assert_matches_peft(base_dir, None, base)


def test_max_loras_limits_the_adapters_of_one_step(base_dir, adapters) -> None:
    """max_loras=1: two adapters never share a step (the scheduler steps over the second, as vLLM),
    the base model does; every output is still exact."""
    engine = LLM(str(base_dir), dtype="float32", num_blocks=128, block_size=4, enable_lora=True, max_loras=1,
                 max_lora_rank=8)
    seen: list[set[int]] = []
    runner = engine.llm_engine.runner
    original = runner.lora_manager.set_step

    def spy(lora_requests, counts):
        seen.append({r.lora_int_id for r in lora_requests if r is not None})
        return original(lora_requests, counts)

    runner.lora_manager.set_step = spy
    loras = [lora(1, adapters[0]), lora(2, adapters[1]), None, lora(1, adapters[0])]
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    for out, req in zip(outs, loras):
        assert_matches_peft(base_dir, Path(req.lora_path) if req else None, out)
    assert max(len(s) for s in seen) == 1 and {1, 2} <= set().union(*seen)
    manager = runner.lora_manager
    assert len(manager.active_adapters) == 1
    # max_cpu_loras defaults to max_loras (1): the host cache holds one adapter, the other is read again.
    assert len(manager.list_adapters()) == 1 and manager.num_loads >= 3


def test_add_and_remove_lora_at_run_time(llm, base_dir, adapters) -> None:
    """vLLM's LLMEngine.add_lora / remove_lora / list_loras: a removed adapter's slot is freed at the
    next step; a request naming it again reads it from disk again and is still exact."""
    engine = llm.llm_engine
    req = lora(4, adapters[1])
    assert engine.add_lora(req) and 4 in engine.list_loras()
    assert_matches_peft(base_dir, adapters[1], llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False, lora_request=req)[0])
    manager = engine.runner.lora_manager
    loads = manager.num_loads
    assert engine.remove_lora(4) and 4 not in engine.list_loras() and not engine.remove_lora(4)
    assert_matches_peft(base_dir, adapters[1], llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False, lora_request=req)[0])
    assert manager.num_loads == loads + 1


def _expect_refused(llm, req: LoRARequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=req)
    assert core_leaks(llm.llm_engine.engine_core) == []


def test_bad_adapters_are_refused_with_the_reason(llm, base_dir, adapters, tmp_path) -> None:
    big = make_peft_adapter(base_dir, tmp_path / "r16", seed=1, r=16)
    _expect_refused(llm, lora(20, big), "LoRA rank 16 is greater than max_lora_rank 8")
    for target in ("embed_tokens", "lm_head"):
        bad = make_peft_adapter(base_dir, tmp_path / target, seed=2, targets=(target, "q_proj"))
        _expect_refused(llm, lora(21, bad), f"{target}.*not supported")
    # An adapter whose shapes are another base model's.
    wrong = tmp_path / "wrong-shape"
    shutil.copytree(adapters[1], wrong)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] * 2, tensors[key].shape[1])
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    _expect_refused(llm, lora(22, wrong), "do not match the base model's q_proj")
    # A layer the base model does not have.
    deep = tmp_path / "deep"
    shutil.copytree(adapters[1], deep)
    tensors = load_file(str(deep / "adapter_model.safetensors"))
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(tensors, str(deep / "adapter_model.safetensors"))
    _expect_refused(llm, lora(23, deep), "layer 7, but the base model has 2 layers")
    dora = tmp_path / "dora"
    shutil.copytree(adapters[1], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    _expect_refused(llm, lora(24, dora), "DoRA")
    _expect_refused(llm, lora(25, tmp_path / "missing"), "missing does not exist")
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request="adapter1")
    with pytest.raises(ValueError, match="2 LoRARequests for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=[None, None])
    # The engine still serves after all that.
    assert_matches_peft(base_dir, adapters[0], llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False,
                                                            lora_request=lora(1, adapters[0]))[0])


def test_lora_request_without_enable_lora_is_refused(base_dir, adapters) -> None:
    engine = LLM(str(base_dir), dtype="float32", num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora(1, adapters[0]))
    with pytest.raises(RequestRejected, match="LoRA is not enabled"):  # the scheduler's own check
        from tokenloom.core.request import Request

        engine.llm_engine.scheduler.add_request(Request("x", [3, 4, 5], SamplingParams(), block_size=4,
                                                        lora_request=lora(1, adapters[0])))


def test_enable_lora_refuses_what_it_cannot_serve(tmp_path) -> None:
    from tests.pooling_models import make_tiny_bert
    from tokenloom.config import ConfigError

    with pytest.raises(ConfigError, match="max_cpu_loras \\(1\\) must be >= max_loras \\(2\\)"):
        LLM("x", enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="LoRA adapters are served on generation models"):
        LLM(str(make_tiny_bert(tmp_path)), enable_lora=True)
    with pytest.raises(ValueError, match="qwen3 is not supported yet"):
        LLM(str(make_tiny_hf_model(tmp_path, arch="qwen3")), dtype="float32", num_blocks=16, enable_lora=True)


def test_lora_request_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")
    assert LoRARequest("a", 1, "/x") == LoRARequest("a", 2, "/y")  # vLLM: the name is the identity


@pytest.mark.parametrize("quantization", ["gguf", "int8", "bfloat16"])
def test_quantized_base_gets_the_adapter(base_dir, adapters, tmp_path, quantization) -> None:
    """Over GGUF blocks (Q8_0), int8 W8A8 layers and a bf16 model the adapter's delta is added to the
    base GEMM: logprobs of the tokens generated agree with the float peft reference within the format's
    error, while the adapter moves them far more; base-only steps of a GGUF model still take the fused
    decode step. (bf16: one-row groups run the LoRA GEMMs in float32, prefill groups in bf16.)"""
    from tests.tiny_models import write_gguf_from_hf

    model = str(write_gguf_from_hf(base_dir, tmp_path / "tiny-q8_0.gguf", "Q8_0")) if quantization == "gguf" \
        else str(base_dir)
    dtype = "bfloat16" if quantization == "bfloat16" else "float32"
    engine = LLM(model, dtype=dtype, num_blocks=64, block_size=4, enable_lora=True, max_loras=2, max_lora_rank=8,
                 quantization=None if quantization == "bfloat16" else quantization)
    loras = [lora(1, adapters[0]), None, lora(3, adapters[2])]
    outs = engine.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=loras)
    for out, req in zip(outs, loras):
        comp = out.outputs[0]
        ref = peft_logprobs(base_dir, Path(req.lora_path) if req else None, out.prompt_token_ids + comp.token_ids[:-1])
        n = len(out.prompt_token_ids)
        got = torch.tensor([lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs)])
        want = ref[n - 1:].gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]
        err = (got - want).abs().max().item()
        assert err < QUANT_TOL, (req, err)
        if req is not None:  # the tolerance would catch a missing delta: the adapter moves these logprobs more
            base = peft_logprobs(base_dir, None, out.prompt_token_ids + comp.token_ids[:-1])
            moved = (base[n - 1:].gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0] - want).abs().max().item()
            assert moved > 4 * QUANT_TOL
    if quantization == "gguf":
        fused = engine.llm_engine.runner.model.fused_step
        assert fused is not None
        calls = []
        original = fused.run_step
        fused.run_step = lambda *a, **k: calls.append(1) or original(*a, **k)
        engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False)  # base only: the fused step runs the decodes
        assert calls
        calls.clear()
        engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=lora(1, adapters[0]))
        assert not calls  # a step with an adapter row runs per op


# ------------------------------------------------------------------------ combinations (docs/lora.md)

REPEATING = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12] * 3}  # n-gram drafts find matches here


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def mixed_reference(llm, adapters):
    """Greedy tokens of a mixed batch (two adapters and the base) on the plain LoRA engine."""
    loras = [lora(1, adapters[0]), None, lora(2, adapters[1])]
    prompts = [REPEATING, PROMPTS[1], PROMPTS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return prompts, loras, params, _tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=loras))


@pytest.mark.parametrize("mode", ["ngram", "async", "ngram+async"])
def test_adapters_with_speculative_decoding_and_async_scheduling(base_dir, mixed_reference, mode) -> None:
    """n-gram drafts are verified with each request's adapter applied (its rows carry its slot), and the
    async engine's model thread applies them too: the greedy tokens equal the plain engine's."""
    prompts, loras, params, want = mixed_reference
    kwargs: dict = {}
    if "ngram" in mode:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                        "prompt_lookup_min": 2}
    if "async" in mode:
        kwargs["async_scheduling"] = True
    engine = LLM(str(base_dir), dtype="float32", num_blocks=128, block_size=4, enable_lora=True, max_loras=2,
                 max_lora_rank=8, **kwargs)
    try:
        assert _tokens(engine.generate(prompts, params, use_tqdm=False, lora_request=loras)) == want
        if "ngram" in mode:
            assert engine.llm_engine.scheduler.spec_decoding_totals.num_draft_tokens > 0
    finally:
        engine.llm_engine.close()


def test_adapters_with_structured_outputs_beam_search_and_the_step_trace(base_dir, adapters, tmp_path) -> None:
    from tokenloom.sampling_params import BeamSearchParams, StructuredOutputsParams

    trace = tmp_path / "steps.jsonl"
    engine = LLM(str(base_dir), dtype="float32", num_blocks=128, block_size=4, enable_lora=True, max_loras=2,
                 max_lora_rank=8, trace_steps=str(trace))
    regex = SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{2}"))
    outs = engine.generate(["Call me at"] * 2, regex, use_tqdm=False, lora_request=[lora(1, adapters[0]), None])
    import re

    for out in outs:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", out.outputs[0].text), out.outputs[0].text
    # Beam search: every beam of the prompt runs its adapter (width 1 is the greedy path's tokens).
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                             use_tqdm=False, lora_request=lora(1, adapters[0]))[0].outputs[0].token_ids
    beams = engine.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True),
                               lora_request=lora(1, adapters[0]))
    assert beams[0].sequences[0].tokens[len(PROMPTS[0]["prompt_token_ids"]):] == greedy
    engine.llm_engine.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    named = [rec["lora"] for rec in lines if "lora" in rec]
    assert named and all(set(names.values()) == {"adapter1"} for names in named)


# ------------------------------------------------------------------------ data parallel

def test_router_prefers_an_engine_holding_the_adapter() -> None:
    """Ray Serve's multiplexed routing: an adapter's requests go to the engine it was sent to before,
    while that engine is not overloaded; prefix hashes carry the adapter, as the engines' do."""
    from tokenloom.core.request import Request
    from tokenloom.router.prefix_index import prompt_block_hashes
    from tokenloom.router.router import Router, RouterConfig

    router = Router(RouterConfig(policy="least_load"), 2, block_size=4, engine_num_blocks=64, lora_capacity=2)
    first = router.route("a0", [1, 2, 3, 4, 5], lora_int_id=7)
    assert all(router.route(f"a{i}", [9, i, 3, 4, 5], lora_int_id=7) == first for i in range(1, 4))
    other = router.route("b0", [1, 2, 3, 4, 5], lora_int_id=8)  # no holder: the policy (least load) decides
    assert other != first and router.lora_decisions == {"holder": 3, "policy": 2}
    for i in range(6):  # the holder is now far busier than the other engine: fall back to load
        router.route(f"c{i}", [i], lora_int_id=7)
    owners = [router.owner[f"c{i}"] for i in range(6)]
    assert owners[0] == first and 1 - first in owners  # imbalanced (in flight 4 more than the other): load wins
    ids = list(range(3, 20))
    lora = LoRARequest("x", 7, "/x")
    assert prompt_block_hashes(ids, 4, (7,)) == Request("r", ids, block_size=4, lora_request=lora).block_hashes
    assert prompt_block_hashes(ids, 4) != prompt_block_hashes(ids, 4, (7,))


@pytest.mark.slow
def test_data_parallel_engines_serve_adapters(base_dir, adapters, mixed_reference) -> None:
    prompts, loras, params, want = mixed_reference
    dp = LLM(str(base_dir), dtype="float32", num_blocks=128, block_size=4, enable_lora=True, max_loras=2,
             max_lora_rank=8, data_parallel_size=2)
    try:
        assert _tokens(dp.generate(prompts, params, use_tqdm=False, lora_request=loras)) == want
        again = dp.generate(prompts, params, use_tqdm=False, lora_request=loras)
        assert _tokens(again) == want
        router = dp.llm_engine.client.client.router
        assert router.lora_decisions["holder"] >= 2  # the second round found its adapters' engines
    finally:
        dp.shutdown()
