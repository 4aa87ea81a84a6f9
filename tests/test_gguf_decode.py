"""FusedDecoder (the whole decode stack in one compiled call, quantized weights) against a plain torch
forward of the dequantized weights, on the default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0).

The decoder quantizes activations to int8 per 32, so the two differ by rounding: hidden states
must stay within cosine 0.99 of the reference at every position and pick the same greedy token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenloom.model.fused_decode import decoder_from_weights
from tokenloom.model.gguf_kernels import gguf_kernels
from tokenloom.model.gguf_weights import GGUFLinear, GGUFWeight, load_gguf_quantized
from tokenloom.model.loader import default_model_path
from tokenloom.model.rotary import rope_inv_freq

kernels = gguf_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="GGUF kernels unavailable (no compiler)")
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]  # "<s>The capital of France is ..." style ids


@pytest.fixture(scope="module")
def model():
    return load_gguf_quantized(default_model_path())


def reference_hidden(config, weights, ids: list[int]) -> torch.Tensor:
    """Final-norm hidden states [T, H] of a dense causal fp32 forward over the dequantized weights."""
    w = {n: v.dequantize() if isinstance(v, GGUFWeight) else v.float() for n, v in weights.items()}
    t, hq, hkv, d = len(ids), config.num_attention_heads, config.num_key_value_heads, config.head_dim
    freqs = torch.outer(torch.arange(t).float(), rope_inv_freq(config))
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]

    def rot(v: torch.Tensor) -> torch.Tensor:
        a, b = v[..., : d // 2], v[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def norm(v: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(v, (config.hidden_size,), w[name], config.rms_norm_eps)

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm.weight")
        q = rot((h @ w[p + "self_attn.q_proj.weight"].T).view(t, hq, d)).transpose(0, 1)[None]
        k = rot((h @ w[p + "self_attn.k_proj.weight"].T).view(t, hkv, d)).transpose(0, 1)[None]
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, hkv, d).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        x = x + o.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, p + "post_attention_layernorm.weight")
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, "model.norm.weight")


def count_fused_runs(model) -> dict[str, int]:
    """Wrap `model.fused_step.run` so calls["n"] counts the steps it took (it returns None to decline)."""
    calls, run = {"n": 0}, model.fused_step.run

    def counted(*args, **kwargs):
        out = run(*args, **kwargs)
        calls["n"] += out is not None
        return out

    model.fused_step.run = counted
    return calls


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decoder_matches_dense_forward(model, kv_dtype: torch.dtype) -> None:
    config, weights = model
    dec = decoder_from_weights(kernels, config, weights)
    layers, hkv, d, bs = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4
    kv = torch.zeros(layers, 2, hkv, 8, bs, d, dtype=kv_dtype)
    dec.set_kv_caches([kv[i, 0] for i in range(layers)], [kv[i, 1] for i in range(layers)])
    freqs = torch.outer(torch.arange(64).float(), rope_inv_freq(config))
    cos, sin = freqs.cos(), freqs.sin()
    # Blocks out of order, so the block table is really followed.
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    got = []
    for pos, tok in enumerate(PROMPT):
        out = torch.empty(1, config.hidden_size)
        slot = int(table[0, pos // bs]) * bs + pos % bs
        dec.step(out, torch.tensor([tok]), torch.tensor([pos]), torch.tensor([slot]), table, cos, sin)
        got.append(out)
    got = torch.cat(got)
    want = reference_hidden(config, weights, PROMPT)
    assert F.cosine_similarity(got, want).min().item() > 0.99
    embed = weights["model.embed_tokens.weight"].dequantize()
    assert (got @ embed.T).argmax(-1).tolist() == (want @ embed.T).argmax(-1).tolist()
    # The quantized LM head (Q8_0, 8-row layout) against the dequantized one on the same rows: int8
    # activations per 32 cost ~1.5 % of the largest logit here (llama.cpp makes the same trade).
    lm_head = GGUFLinear.from_weights([weights["model.embed_tokens.weight"]], [None], kernels)
    assert lm_head.parts[0].packed8
    logits, exact = lm_head(got), got @ embed.T
    assert ((logits - exact).abs().max(dim=-1).values / exact.abs().max(dim=-1).values).max().item() < 0.03
    # Two sequences in one step give each the same as alone.
    table2 = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32)
    out2 = torch.empty(2, config.hidden_size)
    dec.step(out2, torch.tensor([PROMPT[0], PROMPT[0]]), torch.tensor([0, 0]), torch.tensor([20, 4]), table2, cos, sin)
    torch.testing.assert_close(out2[0], out2[1])
    torch.testing.assert_close(out2[0], got[0], rtol=1e-5, atol=1e-5)


def test_decoder_rejects_bad_input(model) -> None:
    config, weights = model
    dec = decoder_from_weights(kernels, config, weights)
    with pytest.raises(RuntimeError, match="KV caches not set"):
        dec.step(torch.empty(1, config.hidden_size), torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
                 torch.zeros(1, 1, dtype=torch.int32), torch.zeros(4, 32), torch.zeros(4, 32))
    kv = torch.zeros(config.num_hidden_layers, 2, config.num_key_value_heads, 2, 4, config.head_dim)
    dec.set_kv_caches([kv[i, 0] for i in range(len(kv))], [kv[i, 1] for i in range(len(kv))])
    cos = torch.zeros(4, config.head_dim // 2)
    with pytest.raises(RuntimeError, match="out of range"):
        dec.step(torch.empty(1, config.hidden_size), torch.tensor([10**6]), torch.tensor([0]), torch.tensor([0]),
                 torch.zeros(1, 2, dtype=torch.int32), cos, cos)
    with pytest.raises(RuntimeError, match="rotary table"):
        dec.step(torch.empty(1, config.hidden_size), torch.tensor([1]), torch.tensor([9]), torch.tensor([0]),
                 torch.zeros(1, 2, dtype=torch.int32), cos, cos)


def test_engine_gguf_matches_dequantized_greedy() -> None:
    """`--quantization gguf` end to end: the fused decode step runs, the weights stay about the
    file's size, and greedy text agrees with the dequantized model's token for token.

    The two differ by the decoder's int8 activations, so a near-tie in the float model may flip: the
    texts must agree up to the first place they differ, and there the float model must rank the
    GGUF token within `tie` nats of its own (a real bug moves logits by far more; on the AMX machine
    where this was written all 16 tokens of four prompts agree)."""
    from tokenloom import LLM, SamplingParams

    tie = 0.25
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    gguf = LLM(quantization="gguf")
    model = gguf.llm_engine.runner.model
    calls = count_fused_runs(model)
    got = [o.outputs[0].token_ids for o in gguf.generate(prompts, params, use_tqdm=False)]
    assert calls["n"] >= 11 * len(prompts) // 2  # decode steps took the fused path
    assert model.weight_bytes() < 1.5 * default_model_path().stat().st_size
    del gguf
    want = [o.outputs[0] for o in LLM(quantization="none", dtype="float32").generate(prompts, params, use_tqdm=False)]
    for g, w in zip(got, want):
        assert len(g) == len(w.token_ids) == 12
        i = next((i for i, (a, b) in enumerate(zip(g, w.token_ids)) if a != b), None)
        if i is None:
            continue
        top = w.logprobs[i]
        assert g[i] in top and top[w.token_ids[i]].logprob - top[g[i]].logprob < tie, (i, g, w.token_ids, top)


def test_gguf_quantization_needs_a_gguf_file(tmp_path) -> None:
    from tokenloom.config import ConfigError, EngineConfig
    from tokenloom.model.loader import load_model

    with pytest.raises(ValueError, match="needs a .gguf model file"):
        load_model(tmp_path, quantized=True)
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(quantization="gguf", device="cuda")


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K blocks of float rows [N, K] (K % 256 == 0; gguf.quants has no K-quant quantizer): per 16
    values a min (<= 0) and a scale of (max - min) / 3, both as four bits of the super-block's dmin / d,
    each value the nearest of its four levels. ggml's layout (block_q2_K): scales[16] (scale | min << 4),
    qs[64] (element 128 h + 32 s + l in bits 2s of byte 32 h + l), d and dmin as float16."""
    n, k = x.shape
    sub = x.reshape(n, k // 256, 16, 16).astype(np.float32)
    mn = np.maximum(0.0, -sub.min(axis=-1))
    sc = (sub.max(axis=-1) + mn) / 3.0
    d = (sc.max(axis=-1) / 15.0).astype(np.float16)
    dmin = (mn.max(axis=-1) / 15.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc4 = np.clip(np.round(np.divide(sc, df, out=np.zeros_like(sc), where=df > 0)), 0, 15).astype(np.uint8)
    mn4 = np.clip(np.round(np.divide(mn, dminf, out=np.zeros_like(mn), where=dminf > 0)), 0, 15).astype(np.uint8)
    step = (df * sc4)[..., None]
    q = np.divide(sub + (dminf * mn4)[..., None], step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.round(q), 0, 3).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [.., h, s, l]
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 2) | (q[:, :, :, 2] << 4) | (q[:, :, :, 3] << 6)).reshape(n, k // 256, 64)
    blocks = np.concatenate([sc4 | (mn4 << 4), qs, d.view(np.uint8).reshape(n, -1, 2),
                             dmin.view(np.uint8).reshape(n, -1, 2)], axis=-1)
    return blocks.reshape(n, -1)


def test_decoder_runs_q2_k_down_projections(model) -> None:
    """The fused step with a K-quant part in its 8-row tile: every layer's down projection (K = 1536, the
    only linear of this model whose K is a multiple of 256) requantized to Q2_K, against the dense
    forward of the same weights dequantized (so only the int8 activations differ)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    config, weights = model
    weights = dict(weights)
    for i in range(config.num_hidden_layers):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        w = weights[name].dequantize().numpy()
        blocks = quantize_q2_k(w)
        back = gguf_dequantize(blocks, GGMLQuantizationType.Q2_K)
        assert np.abs(back - w).mean() < 0.5 * np.abs(w).mean()  # a rough quantizer, but a quantizer
        weights[name] = GGUFWeight(torch.from_numpy(blocks), int(GGMLQuantizationType.Q2_K), tuple(w.shape))
    dec = decoder_from_weights(kernels, config, weights)
    layers, hkv, d, bs = config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4
    kv = torch.zeros(layers, 2, hkv, 8, bs, d)
    dec.set_kv_caches([kv[i, 0] for i in range(layers)], [kv[i, 1] for i in range(layers)])
    freqs = torch.outer(torch.arange(64).float(), rope_inv_freq(config))
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    got = []
    for pos, tok in enumerate(PROMPT):
        out = torch.empty(1, config.hidden_size)
        slot = int(table[0, pos // bs]) * bs + pos % bs
        dec.step(out, torch.tensor([tok]), torch.tensor([pos]), torch.tensor([slot]), table, freqs.cos(), freqs.sin())
        got.append(out)
    want = reference_hidden(config, weights, PROMPT)
    assert F.cosine_similarity(torch.cat(got), want).min().item() > 0.99
