"""--kv-cache-dtype int8 (docs/kv_cache.md): int8 K/V with a float32 scale per token and kv head.

* the arithmetic: quantize then dequantize is within half a step of every value; the kernels' writers
  (rotary_and_cache, the fused decode step) store what the torch writer stores;
* every reader against an fp64 reference on the dequantized cache: the fused paged-attention kernel
  (SIMD and plain loops: AVX-512 decode rows, the tiled AVX2 kernel for chunks, fp32 and bf16 q) and
  the torch path (padded decode groups, SDPA prefill chunks, sliding windows);
* the engine: greedy agreement with float KV on the default model (SmolLM2 GGUF, float32: prefill,
  the fused decode step) and on a sliding-window tiny family; speculative decoding, async scheduling,
  structured outputs, prefix caching and preemption combined with it; the pool holds ~2x the blocks of
  bf16 at the same memory and the never-fits check counts them; bad values are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams, StructuredOutputsParams
from tokenloom.config import CacheConfig, ConfigError, EngineConfig, kv_cache_row_bytes
from tokenloom.core.scheduler import RequestRejected
from tokenloom.model import kernels as kernels_mod
from tokenloom.model.attention import (
    AttentionLayerSpec,
    DecodeMetadata,
    KernelMetadata,
    PrefillMetadata,
    TorchAttentionMetadata,
    causal_offset_mask,
    dequantize_kv,
    paged_attention,
    paged_attention_fused,
    quantize_kv,
    write_kv,
)

K = kernels_mod.cpu_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="compiled CPU kernels unavailable on this machine")


# --------------------------------------------------------------------------- the arithmetic


def test_quantize_dequantize_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-3, 2, 7)[:, None, None]
    x[2, 1] = 0.0  # an all-zero row: scale 0, values 0 (no division by zero)
    x[4, 0, 5] = 300.0  # an outlier sets its row's step
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = dequantize_kv(q, s, torch.float32)
    err = (back - x).abs()
    assert bool((err <= s.unsqueeze(-1) * 0.5 * (1 + 1e-5) + 1e-30).all())
    assert bool((back[2, 1] == 0).all()) and float(s[2, 1]) == 0.0


def _int8_cache(seed: int, hkv: int, num_blocks: int, block_size: int, d: int, outlier: float = 20.0):
    """A random int8 cache (values and scales) from random float K/V."""
    g = torch.Generator().manual_seed(seed)
    kf = torch.randn(hkv, num_blocks, block_size, d, generator=g)
    vf = torch.randn(hkv, num_blocks, block_size, d, generator=g) * 3
    kf[:, :, :, 3] *= outlier  # a large channel, as RoPE'd keys have
    kq, ks = quantize_kv(kf)
    vq, vs = quantize_kv(vf)
    return kq, vq, ks, vs


def _tables(seed: int, num_seqs: int, max_blocks: int, num_blocks: int) -> list[list[int]]:
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return [perm[i * max_blocks : (i + 1) * max_blocks].tolist() for i in range(num_seqs)]


def _reference(qkv, cache, tables, seqs, hq, hkv, d, window=None):
    """fp64 attention over the dequantized contexts: the ground truth every reader is held to."""
    kq, vq, ks, vs = cache
    block_size = kq.shape[2]
    k_all = dequantize_kv(kq, ks, torch.float64).reshape(hkv, -1, d)
    v_all = dequantize_kv(vq, vs, torch.float64).reshape(hkv, -1, d)
    out, row = [], 0
    for table, (s, n) in zip(tables, seqs):
        pos = torch.arange(s + n)
        idx = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = k_all[:, idx].repeat_interleave(hq // hkv, 0)
        v = v_all[:, idx].repeat_interleave(hq // hkv, 0)
        q = qkv[row : row + n, : hq * d].double().view(n, hq, d).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * d**-0.5
        qpos = (s + torch.arange(n))[:, None]
        visible = pos[None, :] <= qpos
        if window is not None:
            visible &= pos[None, :] > qpos - window
        out.append((scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1).reshape(n, hq * d))
        row += n
    return torch.cat(out)


def kernel_metadata(seqs: list[tuple[int, int]], tables: list[list[int]]) -> KernelMetadata:
    """The fused kernel's metadata for a step of `seqs` ((start, rows) each): each row sees keys 0 .. its
    position (the step's K/V already in the cache)."""
    q_start = [0]
    for _, n in seqs:
        q_start.append(q_start[-1] + n)
    return KernelMetadata(block_tables=torch.tensor(tables, dtype=torch.int32),
                          q_start=torch.tensor(q_start, dtype=torch.int32),
                          pos_start=torch.tensor([s for s, _ in seqs], dtype=torch.int32))


# Decodes (one row), a verification-like 4-row chunk, prefill chunks from 0 and continuing a prefix.
SEQS = [(0, 1), (37, 1), (300, 1), (16, 1), (20, 4), (0, 23), (41, 17), (64, 33)]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (6, 3, 48), (4, 4, 32)],
                         ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("force_scalar", [False, True], ids=["simd", "scalar"])
def test_fused_kernel_reads_int8_cache(dtype, block_size, heads, force_scalar) -> None:
    """The fused paged-attention kernel on an int8 cache vs fp64 attention over its dequantized values."""
    hq, hkv, d = heads
    max_blocks = max(-(-(s + n) // block_size) for s, n in SEQS)
    num_blocks = len(SEQS) * max_blocks + 3
    cache = _int8_cache(block_size + d, hkv, num_blocks, block_size, d)
    tables = _tables(1, len(SEQS), max_blocks, num_blocks)
    total = sum(n for _, n in SEQS)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(2)).to(dtype)
    meta = kernel_metadata(SEQS, tables)
    # The kernel's rows see keys 0 .. pos (the K/V of the step already in the cache).
    K.set_force_scalar(force_scalar)
    try:
        out = paged_attention_fused(K, qkv, hq, cache, meta)
    finally:
        K.set_force_scalar(False)
    ref = _reference(qkv, cache, tables, SEQS, hq, hkv, d)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.fixture(scope="module")
def avx2_kernels():
    """The CPU kernels built for an AVX2-only CPU (-march=haswell): on this machine the AVX-512 decode
    kernel serves one-row queries; on AVX2 CPUs the tiled kernel serves them too, with its int8 tile
    dequantization. Built once per source change into the kernel cache (~1 min), as the entry the engine
    builds under TOKENLOOM_CPU_ISA=avx2 (the same stem and flags: test_cpu_isa.py's capped engine reuses it)."""
    from tokenloom.model.kernels import LDFLAGS, SOURCE, load_cached_extension

    if K is None:
        pytest.skip("compiled CPU kernels unavailable")
    module, _ = load_cached_extension("cpu_kernels_avx2", SOURCE,
                                      ["-O3", "-march=haswell", "-fopenmp", "-ffp-contract=off"], LDFLAGS,
                                      "AVX2-only CPU kernels")
    assert not module.has_avx512()
    return module


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (6, 3, 40)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_avx2_only_build_reads_int8_cache(avx2_kernels, dtype, heads) -> None:
    """The same reference check on the kernels as an AVX2-only CPU runs them (decodes, verification
    rows and chunks all through the tiled kernel), and its writer against the torch writer."""
    hq, hkv, d = heads
    bs = 16
    max_blocks = max(-(-(s + n) // bs) for s, n in SEQS)
    num_blocks = len(SEQS) * max_blocks + 3
    cache = _int8_cache(d, hkv, num_blocks, bs, d)
    tables = _tables(3, len(SEQS), max_blocks, num_blocks)
    total = sum(n for _, n in SEQS)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(4)).to(dtype)
    meta = kernel_metadata(SEQS, tables)
    out = paged_attention_fused(avx2_kernels, qkv, hq, cache, meta)
    torch.testing.assert_close(out.double(), _reference(qkv, cache, tables, SEQS, hq, hkv, d), **TOL[dtype])
    slots = torch.arange(total) * 3 % (num_blocks * bs)
    written = tuple(torch.zeros_like(c) for c in cache)
    expected = tuple(torch.zeros_like(c) for c in cache)
    positions = torch.arange(total)
    cos = torch.ones(total, d // 2, dtype=dtype)
    avx2_kernels.rotary_and_cache(qkv.clone(), positions, cos, torch.zeros_like(cos), hq, written[0], written[1],
                                  slots, False, written[2], written[3])
    # cos 1, sin 0: the rotation leaves k as it is, so both writers quantize the same rows.
    k, v = qkv[:, hq * d : (hq + hkv) * d].view(total, hkv, d), qkv[:, (hq + hkv) * d :].view(total, hkv, d)
    write_kv(expected, k, v, slots)
    assert all(torch.equal(a, b) for a, b in zip(written, expected))


def torch_path_metadata(seqs: list[tuple[int, int]], tables: list[list[int]], bs: int) -> TorchAttentionMetadata:
    """The torch path's metadata for a step of `seqs` ((start, rows) each; the decodes first in the flattened
    batch, as the runner orders them): one padded decode group, a prefill chunk per sequence of more rows."""
    slots = torch.tensor([tables[i][p // bs] * bs + p % bs for i, (s, n) in enumerate(seqs)
                          for p in range(s, s + n)])
    dec = [i for i, (_, n) in enumerate(seqs) if n == 1]
    mb = max(seqs[i][0] // bs + 1 for i in dec)
    bt = torch.zeros(len(dec), mb, dtype=torch.long)
    bias = torch.full((1, len(dec), 1, mb * bs), float("-inf"))
    for j, i in enumerate(dec):
        s = seqs[i][0]
        bt[j, : s // bs + 1] = torch.tensor(tables[i][: s // bs + 1])
        bias[0, j, 0, : s + 1] = 0.0
    decodes = [DecodeMetadata(0, len(dec), bt.reshape(-1), mb, bias,
                              query_pos=torch.tensor([seqs[i][0] for i in dec]))]
    prefills, offset = [], len(dec)
    for i, (s, n) in enumerate(seqs):
        if n > 1:
            mask = causal_offset_mask(s, n, "cpu") if s > 0 else None
            prefills.append(PrefillMetadata(offset, n, s + n, torch.tensor(tables[i][: -(-(s + n) // bs)]), mask))
            offset += n
    return TorchAttentionMetadata(slot_mapping=slots, decodes=decodes, prefills=prefills)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 9])
def test_torch_path_reads_int8_cache(dtype, window) -> None:
    """The torch path (decode groups, SDPA / masked prefill chunks, a sliding window) on an int8 cache:
    write_kv quantizes this step's K/V, the readers dequantize the gathered blocks."""
    hq, hkv, d, bs = 6, 2, 32, 4
    seqs = [(5, 1), (30, 1), (12, 1), (0, 11), (17, 6)]
    max_blocks = max(-(-(s + n) // bs) for s, n in seqs)
    num_blocks = len(seqs) * max_blocks + 2
    # No outlier channel here: this path's bf16 GEMMs round the scores to bf16, which a x20 channel
    # turns into errors of the float path, not of the int8 cache.
    cache = _int8_cache(5, hkv, num_blocks, bs, d, outlier=1.0)
    tables = _tables(6, len(seqs), max_blocks, num_blocks)
    g = torch.Generator().manual_seed(7)
    total = sum(n for _, n in seqs)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k = torch.randn(total, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    meta = torch_path_metadata(seqs, tables, bs)
    slots = meta.slot_mapping
    out = paged_attention(q, k, v, cache, meta, AttentionLayerSpec(window=window))
    # The step's own K/V went in quantized: the reference reads the cache as written.
    qkv = torch.cat([q.reshape(total, -1), k.reshape(total, -1), v.reshape(total, -1)], dim=1)
    ref = _reference(qkv, cache, tables, seqs, hq, hkv, d, window)
    kq, _ = quantize_kv(k.transpose(0, 1))
    assert torch.equal(cache[0].view(hkv, -1, d)[:, slots], kq)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_writer_stores_what_the_torch_writer_stores(dtype) -> None:
    """rotary_and_cache on an int8 cache: V (not rotated) byte for byte as write_kv; K within one step
    where the kernel's rotation rounds differently from torch's."""
    from tokenloom.model.config import ModelConfig
    from tokenloom.model.rotary import RotaryEmbedding

    hq, hkv, d, bs, nb, t = 9, 3, 64, 16, 6, 19
    config = ModelConfig("llama", vocab_size=32, hidden_size=hq * d, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
    rope = RotaryEmbedding(config, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 500, (t,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    cache = (torch.zeros(hkv, nb, bs, d, dtype=torch.int8), torch.zeros(hkv, nb, bs, d, dtype=torch.int8),
             torch.zeros(hkv, nb, bs), torch.zeros(hkv, nb, bs))
    expected = tuple(torch.zeros_like(c) for c in cache)
    cos, sin = rope.tables(positions, int(positions.max()))
    qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    write_kv(expected, qk[:, hq:], qkv[:, (hq + hkv) * d :].view(t, hkv, d), slots)
    cos_t, sin_t = rope.full_tables(int(positions.max()))
    fused = qkv.clone()
    K.rotary_and_cache(fused, positions, cos_t, sin_t, hq, cache[0], cache[1], slots, False, cache[2], cache[3])
    assert torch.equal(cache[1], expected[1]) and torch.equal(cache[3], expected[3])
    # K: the kernel rotates in its own rounding (checked in test_attention_kernel.py); what it stores is
    # exactly the torch quantization of the rows it rotated.
    kq, ks = quantize_kv(fused[:, hq * d : (hq + hkv) * d].view(t, hkv, d).transpose(0, 1))
    assert torch.equal(cache[0].view(hkv, -1, d)[:, slots], kq)
    assert torch.equal(cache[2].view(hkv, -1)[:, slots], ks)


@needs_kernels
def test_kernels_refuse_mismatched_scales() -> None:
    kq = torch.zeros(2, 3, 4, 16, dtype=torch.int8)
    out, qkv = torch.empty(1, 32), torch.zeros(1, 96)
    meta = [torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32)]
    with pytest.raises(RuntimeError, match="int8 KV caches need their k_scale"):
        K.paged_attention(out, qkv, kq, kq, *meta, 0.25, False)
    with pytest.raises(RuntimeError, match="float32 \\[Hkv, num_blocks, block_size\\]"):
        K.paged_attention(out, qkv, kq, kq, *meta, 0.25, False, torch.zeros(2, 3, 5), torch.zeros(2, 3, 5))


# --------------------------------------------------------------------------- configuration


def test_vllms_int8_per_token_head_is_this_format() -> None:
    """vLLM's name for int8 values with a float32 scale per token and head: the same cache."""
    assert CacheConfig(cache_dtype="int8_per_token_head").cache_dtype == "int8"
    assert CacheConfig(cache_dtype="int8").cache_dtype == "int8" and CacheConfig().cache_dtype == "auto"


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int4_per_token_head",
                                   "turboquant_k8v4"])
def test_fp8_spellings_refused_by_name(value) -> None:
    with pytest.raises(ConfigError,
                       match=f"kv_cache_dtype='{value}'.*not built.*supported: auto, bfloat16, float16, int8"):
        CacheConfig(cache_dtype=value)


@pytest.mark.parametrize("value", ["int4", "bf16", "", None, 8])
def test_other_values_refused(value) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bfloat16, float16, int8"):
        CacheConfig(cache_dtype=value)


def test_engine_args_and_cli_spell_it_as_vllm() -> None:
    from tokenloom.config import engine_config_from_kwargs

    config = engine_config_from_kwargs(kv_cache_dtype="int8")
    assert isinstance(config, EngineConfig) and config.cache is not None and config.cache.cache_dtype == "int8"
    assert engine_config_from_kwargs(kv_cache_dtype="int8_per_token_head").cache.cache_dtype == "int8"
    with pytest.raises(ConfigError, match="not built"):
        engine_config_from_kwargs(kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("value, said", [
    ("fp8_e4m3", "not built in tokenloom; supported: auto, bfloat16, float16, int8"),
    ("q8_0", "must be one of auto, bfloat16, float16, int8")])
def test_cli_refuses_before_loading_a_model(value, said, capsys) -> None:
    from tokenloom.cli import main as cli_main

    try:
        code = cli_main(["generate", "hi", "--kv-cache-dtype", value])
    except SystemExit as exc:
        code = exc.code
    assert code not in (0, None) and said in capsys.readouterr().err


def test_block_bytes_count_values_and_scales() -> None:
    """A (token, layer, K or V, head) row: D bytes + a 4-byte scale; ~2x the blocks of bf16 (1.88x at
    D = 64, as llama.cpp's q8_0), ~3.8x of float32."""
    assert kv_cache_row_bytes(64, 2, "int8") == 68 and kv_cache_row_bytes(64, 2) == 128
    assert kv_cache_row_bytes(128, 4) / kv_cache_row_bytes(128, 4, "int8") == pytest.approx(3.88, abs=0.01)


# --------------------------------------------------------------------------- the engine

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n\n# compute the mean of", "Water boils at"]
GREEDY = dict(temperature=0.0, max_tokens=32, ignore_eos=True)


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens two greedy runs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _close(llm) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    try:
        assert kv.block_pool.get_num_free_blocks() == kv.num_blocks, "blocks leaked"
    finally:
        llm.llm_engine.close()


def against_the_float32_cache(kv_cache_dtype: str, cache_type: torch.dtype, min_top1: float, capsys) -> None:
    """SmolLM2 GGUF, float32: greedy tokens of PROMPTS with a `kv_cache_dtype` cache against the float32
    cache's. Free-running agreement (tokens shared before they part, per prompt) is reported; asserted:
    each prompt's first token is the same, and teacher-forced, scoring the float32 run's prompt + outputs
    with that cache, its token is the top-1 at >= `min_top1` of the generated positions."""
    kw = dict(dtype="float32", kv_cache_memory=64 << 20, enable_prefix_caching=False)
    ref = LLM(**kw)
    try:
        tok = ref.get_tokenizer()
        ids = [tok.encode(p) for p in PROMPTS]
        want = [list(o.outputs[0].token_ids) for o in ref.generate(
            [{"prompt_token_ids": p} for p in ids], SamplingParams(**GREEDY), use_tqdm=False)]
    finally:
        _close(ref)
    llm = LLM(kv_cache_dtype=kv_cache_dtype, **kw)
    try:
        assert llm.llm_engine.runner.kv_caches[0][0].dtype == cache_type
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in ids], SamplingParams(**GREEDY), use_tqdm=False)]
        scored = llm.generate([{"prompt_token_ids": p + w} for p, w in zip(ids, want)],
                              SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    finally:
        _close(llm)
    top1 = sum(out.prompt_logprobs[len(p) + pos][t].rank == 1
               for p, w, out in zip(ids, want, scored) for pos, t in enumerate(w))
    total = sum(len(w) for w in want)
    with capsys.disabled():
        print(f"\n{kv_cache_dtype} vs float32 KV, SmolLM2 GGUF float32: free-running agreement "
              f"{[_agreement(w, g) for w, g in zip(want, got)]} of {GREEDY['max_tokens']}; teacher-forced top-1 "
              f"{top1}/{total}")
    assert all(w[0] == g[0] for w, g in zip(want, got))
    assert top1 >= min_top1 * total


@pytest.mark.slow
def test_greedy_agreement_with_float_kv_on_the_default_model(capsys) -> None:
    """SmolLM2 GGUF, float32: the int8 run's greedy tokens against the float-KV run's (prefill through
    the fused kernel, decodes through the fused decode step). Free-running agreement is reported (a
    near-tie flips a whole continuation); the claim is teacher-forced: scoring the float run's prompt +
    outputs with the int8 cache, the float run's token is the int8 model's top-1 at >= 93 % of the
    generated positions (186/192 here, AVX-512 Xeon), and each prompt's first token is the same."""
    against_the_float32_cache("int8", torch.int8, 0.93, capsys)


@pytest.fixture(scope="module", params=["mistral", "gemma2"])
def windowed(request, tmp_path_factory) -> tuple[str, str]:
    """Sliding-window tiny families (the torch attention backend): Mistral slides an 8-token window on
    every layer; Gemma 2 alternates windowed and full layers (hybrid KV cache groups: two block tables)
    and soft-caps its scores."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=12)
    return request.param, str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=11))


TINY = dict(dtype="float32", device="cpu", num_blocks=256, block_size=4, max_model_len=256)
TINY_PROMPTS = [[5 + (j % (3 + i)) * 7 for j in range(6 + 5 * i)] for i in range(4)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _tiny_run(path: str, prompts, params, **kw) -> tuple[list[list[int]], object]:
    llm = LLM(path, **{**TINY, **kw})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.llm_engine.scheduler
    finally:
        _close(llm)


def test_sliding_window_family_agrees_with_float_kv(windowed, capsys) -> None:
    """Sliding-window families (8-token windows, 4-token blocks; the torch attention backend): 48
    greedy tokens (6 windows) per prompt with int8 KV against float KV, reported
    (a random tiny model's logits are full of near-ties, so one flip changes the rest); the claim is
    teacher-forced: on the float run's prompt + outputs every logprob is within 0.05 nats of the float
    cache's, and the float run's token is the int8 run's top-1 at >= 95 % of the generated positions."""
    arch, path = windowed
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want, _ = _tiny_run(path, TINY_PROMPTS, params)
    got, sched = _tiny_run(path, TINY_PROMPTS, params, kv_cache_dtype="int8")
    assert sched.kv_cache_manager.kv_cache_groups[0].sliding_window == 8
    agree = [_agreement(w, g) for w, g in zip(want, got)]
    score = SamplingParams(max_tokens=1, prompt_logprobs=1)
    full = [p + w for p, w in zip(TINY_PROMPTS, want)]
    scored = {}
    for kvd in ("auto", "int8"):
        llm = LLM(path, kv_cache_dtype=kvd, **TINY)
        try:
            scored[kvd] = llm.generate([{"prompt_token_ids": p} for p in full], score, use_tqdm=False)
        finally:
            _close(llm)
    worst, top1, total = 0.0, 0, 0
    for p, w, a, b in zip(TINY_PROMPTS, full, scored["auto"], scored["int8"]):
        for pos in range(1, len(w)):
            t = w[pos]
            worst = max(worst, abs(a.prompt_logprobs[pos][t].logprob - b.prompt_logprobs[pos][t].logprob))
            if pos >= len(p):
                top1 += b.prompt_logprobs[pos][t].rank == 1
                total += 1
    with capsys.disabled():
        print(f"\nint8 vs float KV, tiny {arch} (window 8): free-running agreement {agree} of 48; teacher-forced "
              f"top-1 {top1}/{total}, worst logprob change {worst:.4f}")
    assert worst < 0.05
    assert top1 >= 0.95 * total


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_prefix_caching_and_preemption_read_the_same_blocks(tiny_llama, path, monkeypatch) -> None:
    """Prefix caching and preemption are the float cache's: a prompt served again from cached int8
    blocks, and requests preempted and recomputed in a pool too small for all of them, give the tokens
    of the roomy, uncached int8 run (the same quantized bytes either way)."""
    if path == "kernels" and K is None:
        pytest.skip("compiled CPU kernels unavailable")
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "1" if path == "kernels" else "0")
    kw = dict(kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    shared = [7, 3, 9, 11, 2, 5, 8, 13, 21, 34, 1, 4, 6, 10, 12, 14, 15, 16]
    prompts = [shared + [20 + i] for i in range(4)]
    want, _ = _tiny_run(tiny_llama, prompts, params, enable_prefix_caching=False, **kw)
    cached, sched = _tiny_run(tiny_llama, prompts, params, **kw)
    assert sched.kv_cache_manager.prefix_cache_totals.hits > 0
    assert cached == want
    small, sched = _tiny_run(tiny_llama, prompts, params, enable_prefix_caching=False, num_blocks=24, **kw)
    assert sched.num_preemptions_total > 0
    assert small == want


def test_speculative_and_async_scheduling_combine(tiny_llama) -> None:
    """n-gram drafts (verification rows read the int8 cache, rejected drafts' slots rewritten) and async
    scheduling give the plain int8 run's greedy tokens on the float path."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype="int8")
    spec, sched = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype="int8", speculative_config=NGRAM)
    assert sched.spec_decoding_totals is not None and sched.spec_decoding_totals.num_accepted_tokens > 0
    both, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype="int8", speculative_config=NGRAM,
                        async_scheduling=True)
    assert spec == want and both == want


def test_structured_outputs_combine(tiny_llama) -> None:
    """A constrained request (a choice) with int8 KV, drafts and async scheduling: the answer is one of
    the choices, as with float KV."""
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"]))
    llm = LLM(tiny_llama, kv_cache_dtype="int8", speculative_config=NGRAM, async_scheduling=True, **TINY)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params, use_tqdm=False)
    finally:
        _close(llm)
    assert all(o.outputs[0].text in ("alpha", "beta", "gamma") for o in outs)


@pytest.fixture(scope="module")
def tiny_d64(tmp_path_factory) -> str:
    """A tiny Llama with SmolLM2's head size (64), so block sizes compare as on the real model."""
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("d64"), arch="llama", seed=5, head_dim=64))


@pytest.mark.parametrize("dtype, ratio", [("bfloat16", 128 / 68), ("float32", 256 / 68)])
def test_pool_holds_about_twice_the_blocks_of_bf16(tiny_d64, dtype, ratio) -> None:
    """At the same --kv-cache-memory the int8 pool holds (2 D e) / (D + 4) times the blocks of a
    float one (1.88x bf16, 3.76x float32 at D = 64): the block bytes count values and scales."""
    blocks = {}
    for kvd in ("auto", "int8"):
        llm = LLM(tiny_d64, dtype=dtype, kv_cache_dtype=kvd, kv_cache_memory=4 << 20, max_model_len=256)
        try:
            blocks[kvd] = llm.llm_engine.cache_config.num_blocks
            caches = llm.llm_engine.runner.kv_caches
            held = sum(t.numel() * t.element_size() for t in caches[0])  # one layer's K, V (and scales)
            assert held * len(caches) <= 4 << 20  # the pool fits its budget, scales included
        finally:
            _close(llm)
    assert blocks["int8"] / blocks["auto"] == pytest.approx(ratio, rel=0.02)


def test_never_fits_counts_the_int8_block(tiny_d64) -> None:
    """A request too long for the float pool is refused up front (the scheduler's never-fits check, the
    one behind the server's 400); the int8 pool at the same memory holds it and serves it."""
    cfg = json.loads((Path(tiny_d64) / "config.json").read_text())
    bf16_block = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * 16 * 64 * 2
    memory = 6 * bf16_block  # 6 float blocks (96 tokens); 11 int8 ones (176 tokens)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sizes = {}
    for kvd in ("auto", "int8"):
        llm = LLM(tiny_d64, dtype="bfloat16", kv_cache_dtype=kvd, kv_cache_memory=memory, max_model_len=256,
                  block_size=16)
        try:
            pool_tokens = llm.llm_engine.cache_config.num_blocks * 16
            sizes[kvd] = pool_tokens
            prompt = [3 + i % 50 for i in range(sizes["auto"] + 1)]  # one token past the float pool
            if kvd == "auto":
                with pytest.raises(RequestRejected, match="larger than the available KV cache"):
                    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            else:
                out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                assert len(out.outputs[0].token_ids) == 8
        finally:
            _close(llm)
    assert sizes["int8"] > 1.8 * sizes["auto"]


@pytest.mark.slow
def test_data_parallel_engines_take_the_option(tiny_llama) -> None:
    """Two engine processes, each with its own int8 pool: the single int8 engine's greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype="int8")
    llm = LLM(tiny_llama, kv_cache_dtype="int8", data_parallel_size=2, routing_policy="round_robin", **TINY)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params, use_tqdm=False)
        assert llm.llm_engine.client.client.router.num_routed == [2, 2]
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_simulator_sizes_the_int8_pool_as_the_engine() -> None:
    """`tokenloom simulate --kv-cache-dtype int8` sizes its pool with the engine's int8 block (values +
    scales): the shipped SmolLM2 profile (bf16, 23040 bytes a token) gives 1.88x the blocks; a profile
    without the head size refuses int8 by name instead of guessing."""
    from tokenloom.sim.profile import Profile, load_profile
    from tokenloom.sim.simulate import engine_configs

    prof = load_profile("default")
    assert isinstance(prof, Profile) and prof.kv_head_dim == 64
    _, plain = engine_configs(prof, {"kv_cache_memory": 256 << 20})
    _, int8 = engine_configs(prof, {"kv_cache_memory": 256 << 20, "kv_cache_dtype": "int8"})
    assert prof.kv_bytes_per_token_for("int8") == 30 * 2 * 3 * 68
    assert int8.num_blocks == (256 << 20) // (30 * 2 * 3 * 68 * 16)
    assert int8.num_blocks / plain.num_blocks == pytest.approx(128 / 68, rel=0.01)
    prof.kv_head_dim = 0
    with pytest.raises(ValueError, match="KV head size"):
        engine_configs(prof, {"kv_cache_dtype": "int8"})


def test_an_encoder_refuses_it(tmp_path) -> None:
    """A BERT-style encoder keeps no KV cache: int8 KV is refused by name, not silently ignored."""
    from tests.pooling_models import make_tiny_bert

    with pytest.raises(ConfigError, match="an encoder .* keeps no KV cache"):
        LLM(str(make_tiny_bert(tmp_path, seed=1)), runner="pooling", dtype="float32", kv_cache_dtype="int8")


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kvd", ["int8", "float16"])
def test_fused_decode_step_reads_int8_and_16bit_caches(tiny_llama, dtype, kvd, monkeypatch) -> None:
    """The fused decode step (FusedDecoder over float weights, TOKENLOOM_FUSED_FLOAT=1) on an int8 (or a
    float16: tests/test_kv_16bit.py) cache against the per-op kernels on one: the decode steps' logits agree
    as closely as the two paths do on a float cache (both quantize / round the same rows), the step writes
    int8 rows with their scales (16-bit rows within an fp16 step of the per-op kernels'), and it really ran
    every decode step."""
    from tests.test_fused_float_decode import TOL as FUSED_TOL
    from tests.test_fused_float_decode import _decode, _requests
    from tests.test_gguf_decode import count_fused_runs
    from tests.test_model_runner import BLOCK
    from tokenloom.model.gguf_kernels import gguf_kernels
    from tokenloom.model.loader import load_model
    from tokenloom.model.runner import ModelRunner

    if gguf_kernels() is None:
        pytest.skip("GGUF kernels unavailable")
    loaded = load_model(Path(tiny_llama), torch.float32)
    runners = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setenv("TOKENLOOM_FUSED_FLOAT", "1")
            m.setenv("TOKENLOOM_FUSED_DECODE_ROWS", "8" if fused else "0")
            runners[fused] = ModelRunner(loaded, block_size=BLOCK, num_blocks=64, dtype=dtype, device="cpu",
                                         cpu_kernels=True, kv_cache_dtype=kvd)
        assert (runners[fused].model.fused_step is not None) == fused
        assert runners[fused].kv_caches[0][0].dtype == getattr(torch, kvd)
        assert len(runners[fused].kv_caches[0]) == (4 if kvd == "int8" else 2)
    calls = count_fused_runs(runners[True].model)
    reqs = _requests(3)
    got, want = _decode(runners[True], reqs, 4), _decode(runners[False], reqs, 4)
    assert calls["n"] == 4
    for prompt_ids, blocks in reqs.values():  # the pool is uninitialised: look where the requests wrote
        last = len(prompt_ids) + 3  # the last decode step's position
        at = (slice(None), blocks[last // BLOCK], last % BLOCK)
        if kvd == "int8":
            assert bool((runners[True].kv_caches[0][2][at] > 0).all())
            continue
        for a, b in zip(runners[True].kv_caches[0], runners[False].kv_caches[0]):
            assert bool(torch.isfinite(a[at]).all())
            torch.testing.assert_close(a[at].float(), b[at].float(), rtol=2e-3, atol=2e-3)
    for g, w in zip(got, want):  # measured: 6e-7 (float32), 0.011 (bf16)
        torch.testing.assert_close(g, w, rtol=0, atol=FUSED_TOL[dtype])


def test_w8a8_layers_combine(tiny_llama, capsys) -> None:
    """--quantization int8 (W8A8 decoder layers) over an int8 KV cache: scoring the float-KV W8A8 run's
    prompt + greedy outputs, the int8-KV W8A8 engine's top-1 is that run's token at >= 90 % of the
    generated positions (free-running agreement reported: a random tiny model is full of near-ties)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, quantization="int8")
    got, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, quantization="int8", kv_cache_dtype="int8")
    llm = LLM(tiny_llama, quantization="int8", kv_cache_dtype="int8", **TINY)
    try:
        scored = llm.generate([{"prompt_token_ids": p + w} for p, w in zip(TINY_PROMPTS, want)],
                              SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    finally:
        _close(llm)
    top1 = sum(o.prompt_logprobs[len(p) + j][t].rank == 1
               for p, w, o in zip(TINY_PROMPTS, want, scored) for j, t in enumerate(w))
    with capsys.disabled():
        print(f"\nW8A8 + int8 KV vs W8A8 + float KV, tiny Llama: free-running agreement "
              f"{[_agreement(w, g) for w, g in zip(want, got)]} of 16; teacher-forced top-1 {top1}/{16 * len(want)}")
    assert top1 >= 0.9 * 16 * len(want)
