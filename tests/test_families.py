"""Qwen3, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3 and Mistral against transformers, on tiny random models built
from transformers' own config classes (tests/tiny_models.py; 2 layers, hidden 64, sliding window 8
= two blocks of 4 where the family has one).

* one batch mixing a chunked prefill, prefix-cache hits and decodes (test_model_runner's steps);
* greedy tokens identical to transformers' generate, the real scheduler driving the runner, with a
  prompt longer than the window; for Mistral (every layer windowed) the KV blocks a request holds
  stay bounded by the window while it runs, for Gemma those of its sliding KV cache group (hybrid
  groups; more in tests/test_hybrid_kv.py);
* MoE routing: ties go to the lower expert (torch.topk), an expert with no token costs nothing;
* Mixtral: logprobs of 16 greedy tokens, 3 prompts in one batch through LLM, within 2e-3 of transformers'.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tests.test_model_runner as tmr
from tests.test_model_runner import BLOCK, Tiny, prompt
from tests.tiny_models import make_tiny_hf_model, write_gguf_from_hf
from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.kv_cache_groups import make_kv_cache_groups
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.model.hf import config_from_hf, hf_dict_from_config
from tokenloom.model.hf_overrides import ModelOverrides
from tokenloom.model.loader import load_model, load_model_config
from tokenloom.model.models.qwen3_moe import grouped_experts, route
from tokenloom.model.runner import ModelRunner
from tokenloom.sampling_params import SamplingParams

FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "mistral"]
# llama.cpp writes Mixtral as a "llama" GGUF with experts and no sliding window: its HF twin has none either.
GGUF_OVERRIDES = {"mixtral": {"sliding_window": None}}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return Tiny(hf=hf, loaded=load_model(path, torch.float32))


@tmr.PATHS
def test_mixed_step_matches_transformers(family: Tiny, path: str) -> None:
    """Both paths: "kernels" runs the compiled kernels' linears, with the torch attention backend
    for the families whose windows / soft-capping the fused kernel lacks."""
    tmr.test_mixed_step_matches_transformers(family, path)


def test_greedy_32_tokens_match_generate(family: Tiny) -> None:
    """Scheduler + runner (chunked prefill of 8-token chunks, prefix caching) generate exactly what
    transformers generates greedily, past the window; a windowed layer group's requests hold a bounded
    number of blocks (every layer for Mistral; Gemma's sliding group of its hybrid KV cache groups)."""
    windows = family.loaded.config.sliding_windows
    layer_windows = tuple(windows) if any(w is not None for w in windows) else None
    num_blocks = 40
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=True, layer_windows=layer_windows),
        clock=lambda: 0.0,
    )
    kv = sched.kv_cache_manager
    # One group, or (Gemma's sliding + full layers) a sliding group first and a full one.
    assert len(kv.kv_cache_groups) == len(set(windows))
    uniform = kv.kv_cache_groups[0].sliding_window  # the sliding group's window, if any
    runner = family.runner(num_blocks=num_blocks, kv_cache_groups=make_kv_cache_groups(
        layer_windows, family.loaded.config.num_hidden_layers))  # the engine's: the scheduler's, with layer ids
    shared = prompt(40, 12)
    prompts = {"a": shared + prompt(41, 7), "b": shared + prompt(42, 3)}
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)))
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    most_held = prefix_hits = 0
    for _ in range(300):
        if not sched.has_requests():
            break
        so = sched.schedule()
        prefix_hits += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
        for out in sched.update_from_output(so, runner.execute_model(so)):
            assert out.error is None
            generated[out.request_id] += out.new_token_ids
        if uniform is not None:
            most_held = max([most_held] + [kv.managers[0].num_blocks_held(r) for r in kv.req_to_blocks])
    assert prefix_hits == 1  # "b" reuses "a"'s cached prefix blocks (through the window for Mistral)
    if uniform is not None:  # 19 + 32 tokens = 13 blocks without freeing; the window keeps <= 5
        assert 0 < most_held <= -(-(uniform - 1 + 8) // BLOCK) + 1, most_held
    for rid, p in prompts.items():
        expected = family.hf.generate(
            torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p):].tolist()
        assert generated[rid] == expected, rid


def test_moe_routing_ties_and_idle_expert() -> None:
    # Token 0: experts 1 and 2 tie for the top: topk keeps the lower index first (as transformers).
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [3.0, -5.0, 1.0, -5.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2], [0, 2]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    # Expert 3 receives no token: it is skipped, and the result equals the per-token reference.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g)
    w_gate_up, w_down = torch.randn(4, 6, 8, generator=g), torch.randn(4, 8, 3, generator=g)
    w_down[3] = float("nan")  # would poison the output if expert 3 ran on anything
    out = grouped_experts(x, weights, experts, w_gate_up, w_down)
    ref = torch.zeros_like(x)
    for t in range(2):
        for k in range(2):
            e = int(experts[t, k])
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            ref[t] += weights[t, k] * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, ref)


def test_mixtral_logprobs_in_one_batch_match_transformers(tmp_path: Path) -> None:
    """A tiny random Mixtral (4 experts, top-2, sliding window 8) through the engine: 3 prompts in one
    batch, 16 greedy tokens each, the same tokens as transformers' and each token's logprob within 2e-3."""
    from tokenloom import LLM

    path = make_tiny_hf_model(tmp_path, arch="mixtral", seed=7)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [prompt(50, 5), prompt(51, 11), prompt(52, 17)]
    llm = LLM(str(path), dtype="float32", quantization="none", num_blocks=64, block_size=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
    finally:
        llm.llm_engine.close()
    for p, out in zip(prompts, outs):
        comp = out.outputs[0]
        ids = torch.tensor([p + comp.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        want = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
        assert comp.token_ids == want
        for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert abs(entry[tok].logprob - logprobs[len(p) - 1 + i, tok].item()) < 2e-3, (i, tok)


def test_mixtral_int8_is_refused_as_qwen3_moe(tmp_path: Path) -> None:
    loaded = load_model(make_tiny_hf_model(tmp_path, arch="mixtral", seed=8), torch.float32)
    with pytest.raises(ValueError, match="not implemented for mixtral"):
        ModelRunner(loaded, block_size=BLOCK, num_blocks=8, dtype="float32", device="cpu", quantization="int8")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3"])
def test_gguf_matches_hf_dir(arch: str, tmp_path: Path) -> None:
    """A GGUF written with gguf's writer under llama.cpp's names and conventions (stacked experts,
    Gemma's 1 + w norms, Phi-3's fused tensors) loads to the same weights and config, so the same
    logits, as its HF directory. (llama.cpp writes Mistral as a plain "llama" GGUF, without its
    window: covered by test_loader's Llama GGUF tests.)"""
    hf_dir = make_tiny_hf_model(tmp_path / "hf", arch=arch, seed=4, **GGUF_OVERRIDES.get(arch, {}))
    from_hf = load_model(hf_dir, torch.float32)
    from_gguf = load_model(write_gguf_from_hf(hf_dir, tmp_path / f"{arch}.gguf"), torch.float32)
    for field in ("architecture", "sliding_windows", "hidden_act", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_local_base_freq", "num_experts", "num_experts_per_tok",
                  "norm_topk_prob", "rope_theta", "head_dim"):
        assert getattr(from_gguf.config, field) == getattr(from_hf.config, field), field
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, w in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], w, atol=1e-6, rtol=0, msg=name)
    logits = []
    for loaded in (from_hf, from_gguf):
        runner = ModelRunner(loaded, block_size=BLOCK, num_blocks=16, dtype="float32", device="cpu")
        tokens = prompt(7, 14)
        runner.execute_model(tmr.step({"r": 14}, new=[tmr.new_req("r", tokens, [1, 2, 3, 4])]), return_logits=True)
        logits.append(runner.last_logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
    # hf_overrides on a GGUF edit its metadata in Hugging Face's names (what transformers gives vLLM for a GGUF),
    # which reads back as the GGUF's own config, and then as the same overrides on its config.json.
    config = from_gguf.config
    back = config_from_hf(hf_dict_from_config(config), name=config.name, check_rope=False)
    assert replace(back, extra=config.extra) == config
    overrides = ModelOverrides({"num_hidden_layers": 1, "max_position_embeddings": 128, "rms_norm_eps": 1e-3})
    on_hf, on_gguf = (load_model_config(p, overrides) for p in (hf_dir, tmp_path / f"{arch}.gguf"))
    assert (on_gguf.num_hidden_layers, on_gguf.max_position_embeddings, on_gguf.rms_norm_eps) == (1, 128, 1e-3)
    assert replace(on_gguf, name=on_hf.name, extra=on_hf.extra) == on_hf


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_disable_sliding_window_runs_as_transformers_without_a_window(arch: str, tmp_path: Path) -> None:
    """vLLM's disable_sliding_window: every layer attends to the whole sequence (the runner's logits match
    transformers' model given a window longer than the prompts), Gemma 3's sliding layers keep their local rope
    base, and the context is capped at the window (vLLM's derived max_model_len, key sliding_window)."""
    path = make_tiny_hf_model(tmp_path, arch=arch, seed=3)
    loaded = load_model(path, torch.float32, overrides=ModelOverrides(disable_sliding_window=True))
    config = loaded.config
    assert config.sliding_window is None and config.sliding_windows == [None, None]
    assert (config.context_length, config.context_length_key, config.max_position_embeddings) == \
        (8, "sliding_window", 256)
    if arch == "gemma3":
        assert config.layer_types == ["sliding_attention", "full_attention"] and config.is_sliding_layer(0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              sliding_window=256).eval()
    tmr.test_mixed_step_matches_transformers(Tiny(hf=hf, loaded=loaded), None)  # prompts of up to 13 > 8 tokens
    assert ModelOverrides(disable_sliding_window=True).finish(load_model_config(path)).context_length == 8
    plain = make_tiny_hf_model(tmp_path / "plain", arch="llama", seed=3)
    assert load_model_config(plain, ModelOverrides(disable_sliding_window=True)) == load_model_config(plain)


def test_gguf_tensors_not_matching_architecture(tmp_path: Path) -> None:
    """A qwen3 GGUF without its q/k norms fails at load (before any KV cache), naming the tensors."""
    hf_dir = make_tiny_hf_model(tmp_path / "hf", arch="qwen3", seed=5)
    path = write_gguf_from_hf(hf_dir, tmp_path / "q.gguf")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "broken.gguf"), "qwen3")
    for field in reader.fields.values():
        if field.name.startswith("qwen3.") and field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        if "attn_k_norm" not in t.name:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"qwen3 model.*missing.*k_norm"):
        load_model(tmp_path / "broken.gguf", torch.float32)


@pytest.mark.parametrize(("change", "message"), [
    ({"query_pre_attn_scalar": None}, r"no 'query_pre_attn_scalar', which a gemma2 model needs"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, r"rope_scaling type 'yarn'"),
    ({"hidden_activation": "relu"}, r"hidden_act 'relu' for gemma2"),
])
def test_bad_config_fields_named(change: dict, message: str, tmp_path: Path) -> None:
    hf_dir = make_tiny_hf_model(tmp_path / "hf", arch="gemma2", seed=6)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(change)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(hf_dir, torch.float32)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3"])
def test_gguf_quantization_keeps_the_family_blocks(arch: str, tmp_path: Path) -> None:
    """`--quantization gguf` on a Q8_0 GGUF of each family: the quantized loader applies the family's
    names and conventions as the dequantizing one does (it used Llama's names: Gemma 3's q/k norms were
    "unexpected"), the matrices stay GGUF blocks (dequantized: the dequantizing loader's weights),
    Phi-3's fused ones split into row views, and the logits of a 40-token prefill and a decode step
    (the kernels quantize activations to int8) stay within 5% of the dequantized model's logit range."""
    from tokenloom.model.gguf_weights import GGUFWeight

    hf_dir = make_tiny_hf_model(tmp_path / "hf", arch=arch, seed=4, **GGUF_OVERRIDES.get(arch, {}))
    path = write_gguf_from_hf(hf_dir, tmp_path / f"{arch}.gguf", qtype="Q8_0")
    plain, quant = load_model(path, torch.float32), load_model(path, torch.float32, quantized=True)
    assert quant.weights.keys() == plain.weights.keys()
    blocks = [n for n, w in quant.weights.items() if isinstance(w, GGUFWeight)]
    assert any("q_proj" in n for n in blocks) and any("o_proj" in n for n in blocks), blocks
    for name, w in quant.weights.items():
        got = w.dequantize() if isinstance(w, GGUFWeight) else w
        torch.testing.assert_close(got, plain.weights[name], atol=1e-6, rtol=0, msg=name)
    logits = []
    for loaded, q in ((plain, None), (quant, "gguf")):
        runner = ModelRunner(loaded, block_size=BLOCK, num_blocks=24, dtype="float32", device="cpu", quantization=q)
        tokens = prompt(9, 40)
        runner.execute_model(tmr.step({"r": 40}, new=[tmr.new_req("r", tokens, list(range(1, 11)))]),
                             return_logits=True)
        prefill = runner.last_logits.clone()
        runner.execute_model(tmr.step({"r": 1}, cached=[("r", [11], 40)]), return_logits=True)
        logits.append((prefill, runner.last_logits.clone()))
    for want, got in zip(*logits):  # the prefill's last row, then the decode step's
        assert (got - want).abs().max() <= 5e-2 * (want.max() - want.min()), (got - want).abs().max()


@pytest.mark.parametrize("arch, ops", [("gemma3", "GELU-tanh MLP activation, the post-attention / post-MLP norms, "
                                                  "the q/k RMSNorm"),
                                       ("qwen3_moe", "the q/k RMSNorm, the routed experts"),
                                       ("mixtral", "the routed experts"), ("llama", None)])
def test_the_log_names_what_runs_as_torch_ops(arch: str, ops: str | None, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Where a family's op has no compiled CPU kernel yet the torch op runs, and the load says so."""
    from tokenloom.model.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built: everything is a torch op")
    loaded = load_model(make_tiny_hf_model(tmp_path, arch=arch, seed=2), torch.float32)
    with caplog.at_level("INFO", logger="tokenloom.model.decoder_model"):
        ModelRunner(loaded, block_size=BLOCK, num_blocks=8, dtype="float32", device="cpu")
    said = [r.getMessage() for r in caplog.records if "no fused CPU kernel yet" in r.getMessage()]
    if ops is None:
        assert not said, said
    else:
        assert len(said) == 1 and ops in said[0], said
