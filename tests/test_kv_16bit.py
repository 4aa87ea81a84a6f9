"""--kv-cache-dtype bfloat16 / float16 (docs/kv_cache.md): K and V stored in a 16-bit type whatever the run
dtype, so a float32 run (the default on CPUs without AVX512-BF16) keeps half the bytes per token.

* the arithmetic: every reader of a 16-bit cache gives what it gives on a cache of the run dtype holding the
  same rounded values (the fused paged-attention kernel, SIMD and plain loops, fp32 and bf16 queries; the
  torch path), and every writer stores the run dtype's values rounded to nearest even (rotary_and_cache,
  the fused decode step, write_kv);
* the engine: the pool holds twice the blocks of float32 at the same memory; the default model's greedy
  tokens with a float16 cache against float32's (teacher-forced); naming the run dtype is auto (the packed
  bf16 layout kept); prefix caching and preemption, speculative decoding with async scheduling, tensor and
  pipeline parallel workers and the KV offloading tiers (int8 caches too) combine with it. (The fused
  decode step on these caches: tests/test_kv_int8.py against the per-op kernels, tests/test_fused_float_decode.py
  its grouped attention.)
"""

from __future__ import annotations

import pytest
import torch

from tests.test_kv_int8 import (
    NGRAM,
    TINY,
    TINY_PROMPTS,
    K,
    _close,
    _tiny_run,
    against_the_float32_cache,
    kernel_metadata,
    needs_kernels,
    torch_path_metadata,
)
from tests.tiny_models import make_tiny_hf_model
from tokenloom import LLM, SamplingParams
from tokenloom.config import CacheConfig, ConfigError, auto_kv_cache_dtype, kv_cache_row_bytes
from tokenloom.model.attention import (
    paged_attention,
    paged_attention_fused,
    write_kv,
)

KV16 = [torch.float16, torch.bfloat16]
KV16_IDS = ["fp16", "bf16"]

# Decodes (one row), a verification-like 4-row chunk, prefill chunks from 0 and continuing a prefix.
SEQS = [(0, 1), (37, 1), (300, 1), (16, 1), (20, 4), (0, 23), (41, 17), (64, 33)]


def _case(seed: int, hq: int, hkv: int, d: int, bs: int, run: torch.dtype):
    """Random K/V (a large channel, as RoPE'd keys have), block tables, q rows and the kernel's metadata."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(s + n) // bs) for s, n in SEQS)
    nb = len(SEQS) * max_blocks + 3
    k = torch.randn(hkv, nb, bs, d, generator=g)
    k[..., 3] *= 20
    v = torch.randn(hkv, nb, bs, d, generator=g) * 3
    perm = torch.randperm(nb, generator=g)
    tables = [perm[i * max_blocks : (i + 1) * max_blocks].tolist() for i in range(len(SEQS))]
    total = sum(n for _, n in SEQS)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=g).to(run)
    return k, v, qkv, kernel_metadata(SEQS, tables)


@needs_kernels
@pytest.mark.parametrize("kv", KV16, ids=KV16_IDS)
@pytest.mark.parametrize("run", [torch.float32, torch.bfloat16], ids=["fp32-run", "bf16-run"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (6, 3, 40)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("force_scalar", [False, True], ids=["simd", "scalar"])
def test_fused_kernel_reads_a_16bit_cache_as_its_values(kv, run, heads, force_scalar) -> None:
    """The kernel on a 16-bit cache gives exactly what it gives on a cache of the run dtype holding the same
    values (the conversion is exact and the arithmetic after it the same), where the run dtype holds them
    exactly (float32; bf16 under bf16); fp16 values under a bf16 run are held to an fp64 reference instead."""
    if run == torch.bfloat16 and kv == torch.bfloat16:
        pytest.skip("a bf16 cache under a bf16 run is the auto cache (tests/test_attention_kernel.py)")
    hq, hkv, d = heads
    k, v, qkv, meta = _case(d + hq, hq, hkv, d, 16, run)
    cache16 = (k.to(kv), v.to(kv))
    K.set_force_scalar(force_scalar)
    try:
        got = paged_attention_fused(K, qkv, hq, cache16, meta)
        if run == torch.float32:
            want = paged_attention_fused(K, qkv, hq, (cache16[0].float(), cache16[1].float()), meta)
    finally:
        K.set_force_scalar(False)
    assert got.dtype == run
    if run == torch.float32:
        assert torch.equal(got, want)
        return
    # fp64 attention over the fp16 values, per sequence.
    kd, vd = cache16[0].double().reshape(hkv, -1, d), cache16[1].double().reshape(hkv, -1, d)
    ref, row = [], 0
    tables = meta.block_tables.tolist()
    for table, (s, n) in zip(tables, SEQS):
        pos = torch.arange(s + n)
        idx = torch.tensor(table)[pos // 16] * 16 + pos % 16
        kk = kd[:, idx].repeat_interleave(hq // hkv, 0)
        vv = vd[:, idx].repeat_interleave(hq // hkv, 0)
        q = qkv[row : row + n, : hq * d].double().view(n, hq, d).transpose(0, 1)
        scores = (q @ kk.transpose(1, 2) * d**-0.5).masked_fill(pos[None, :] > (s + torch.arange(n))[:, None],
                                                                 float("-inf"))
        ref.append((scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, hq * d))
        row += n
    torch.testing.assert_close(got.double(), torch.cat(ref), atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize("kv", KV16, ids=KV16_IDS)
def test_kernel_writer_rounds_each_value_to_the_cache_type(kv) -> None:
    """rotary_and_cache under a float32 run into a 16-bit cache: each K row is the rotated row (as the same
    kernel writes it into a float32 cache) rounded to nearest even, each V row the input's."""
    hq, hkv, d, bs, nb, t = 9, 3, 64, 16, 6, 19
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    positions = torch.randint(0, 500, (t,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    angles = torch.rand(512, d // 2, generator=g) * 6.28
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    full = (torch.zeros(hkv, nb, bs, d), torch.zeros(hkv, nb, bs, d))
    half = (torch.zeros(hkv, nb, bs, d, dtype=kv), torch.zeros(hkv, nb, bs, d, dtype=kv))
    a, b = qkv.clone(), qkv.clone()
    K.rotary_and_cache(a, positions, cos, sin, hq, full[0], full[1], slots, False)
    K.rotary_and_cache(b, positions, cos, sin, hq, half[0], half[1], slots, False)
    assert torch.equal(a, b)  # the rotated q/k rows do not depend on the cache
    for f, h in zip(full, half):
        assert torch.equal(h.view(hkv, -1, d)[:, slots], f.view(hkv, -1, d)[:, slots].to(kv))
    with pytest.raises(RuntimeError, match="packed KV layout needs bf16 qkv and caches"):
        K.rotary_and_cache(qkv.clone(), positions, cos, sin, hq, half[0], half[1], slots, True)


@pytest.mark.parametrize("kv", KV16, ids=KV16_IDS)
def test_torch_path_reads_and_writes_a_16bit_cache(kv) -> None:
    """The torch path (padded decode groups, SDPA prefill chunks) on a 16-bit cache under a float32 run:
    write_kv rounds this step's K/V into the cache, and the output is the one on a float32 cache holding
    those rounded values."""
    hq, hkv, d, bs = 6, 2, 32, 4
    seqs = [(5, 1), (30, 1), (12, 1), (0, 11), (17, 6)]
    max_blocks = max(-(-(s + n) // bs) for s, n in seqs)
    nb = len(seqs) * max_blocks + 2
    g = torch.Generator().manual_seed(7)
    base = (torch.randn(hkv, nb, bs, d, generator=g).to(kv), torch.randn(hkv, nb, bs, d, generator=g).to(kv))
    perm = torch.randperm(nb, generator=g)
    tables = [perm[i * max_blocks : (i + 1) * max_blocks].tolist() for i in range(len(seqs))]
    total = sum(n for _, n in seqs)
    q, k, v = (torch.randn(total, h, d, generator=g) for h in (hq, hkv, hkv))
    meta = torch_path_metadata(seqs, tables, bs)
    slots = meta.slot_mapping
    cache16 = (base[0].clone(), base[1].clone())
    got = paged_attention(q, k, v, cache16, meta)
    assert torch.equal(cache16[0].view(hkv, -1, d)[:, slots], k.transpose(0, 1).to(kv))
    cache32 = (base[0].float(), base[1].float())
    write_kv(cache32, k.to(kv).float(), v.to(kv).float(), slots)
    want = paged_attention(q, k.to(kv).float(), v.to(kv).float(), cache32, meta)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# --------------------------------------------------------------------------- configuration


def test_vllms_names_are_accepted_and_size_two_bytes_a_value() -> None:
    assert CacheConfig(cache_dtype="float16").cache_dtype == "float16"
    assert CacheConfig(cache_dtype="bfloat16").cache_dtype == "bfloat16"
    assert kv_cache_row_bytes(64, 4, "float16") == kv_cache_row_bytes(64, 4, "bfloat16") == 128
    assert kv_cache_row_bytes(64, 4) == 256 and kv_cache_row_bytes(64, 2, "float16") == 128
    with pytest.raises(ConfigError, match="must be one of auto, bfloat16, float16, int8"):
        CacheConfig(cache_dtype="half")


def test_cli_takes_the_option(capsys) -> None:
    from tokenloom.cli import main as cli_main

    assert cli_main(["generate", "The capital of France is", "--kv-cache-dtype", "float16", "--max-tokens", "4",
                     "--temperature", "0"]) in (0, None)
    assert "Paris" in capsys.readouterr().out


def test_simulator_sizes_a_16bit_pool_as_the_engine() -> None:
    """`tokenloom simulate --kv-cache-dtype float16` sizes its pool with 2-byte values: the shipped bf16
    profile's pool is unchanged, a float32 profile's (the same model profiled in float32) holds 2x."""
    from dataclasses import replace

    from tokenloom.sim.profile import load_profile
    from tokenloom.sim.simulate import engine_configs

    prof = load_profile("default")
    assert prof.dtype == "bfloat16"
    _, plain = engine_configs(prof, {"kv_cache_memory": 256 << 20})
    _, half = engine_configs(prof, {"kv_cache_memory": 256 << 20, "kv_cache_dtype": "float16"})
    assert half.num_blocks == plain.num_blocks
    f32 = replace(prof, dtype="float32", kv_bytes_per_token=2 * prof.kv_bytes_per_token)
    _, plain = engine_configs(f32, {"kv_cache_memory": 256 << 20})
    _, half = engine_configs(f32, {"kv_cache_memory": 256 << 20, "kv_cache_dtype": "bfloat16"})
    assert half.num_blocks == 2 * plain.num_blocks


def test_simulator_sizes_auto_as_the_profiled_engine_stored_it() -> None:
    """A profile records the cache its engine stored under auto: a float32 profile of a GGUF made where --dtype
    auto runs float32 stored float16 K/V, and `simulate` sizes auto (and float16) as that pool; bfloat16 the
    same 2 bytes, int8 its own rows."""
    from dataclasses import replace

    from tokenloom.sim.profile import Profile, load_profile
    from tokenloom.sim.simulate import engine_configs

    prof = load_profile("default")
    f32 = replace(prof, dtype="float32", kv_bytes_per_token=2 * prof.kv_bytes_per_token)
    stored = Profile.from_dict(replace(f32, kv_cache_dtype="float16").to_dict())  # the field is saved
    assert stored.kv_cache_dtype == "float16"
    sizes = {kvd: engine_configs(stored, {"kv_cache_memory": 256 << 20, "kv_cache_dtype": kvd})[1].num_blocks
             for kvd in ("auto", "float16", "bfloat16", "int8")}
    assert sizes["auto"] == sizes["float16"] == sizes["bfloat16"]
    assert sizes["auto"] == 2 * engine_configs(f32, {"kv_cache_memory": 256 << 20})[1].num_blocks
    assert sizes["int8"] == engine_configs(f32, {"kv_cache_memory": 256 << 20, "kv_cache_dtype": "int8"})[1].num_blocks


def test_auto_is_the_models_dtype() -> None:
    """vLLM's rule, `auto` = the model's dtype: the run's, except that a float32 run `--dtype auto` chose on a
    CPU without native bf16 (or `--dtype float16`, which runs as auto's choice) keeps a 16-bit checkpoint's
    type, and a GGUF's f16."""
    assert auto_kv_cache_dtype("auto", "auto", "float32", "float16") == "float16"  # a GGUF on an AVX2 CPU
    assert auto_kv_cache_dtype("auto", "auto", "float32", "bfloat16") == "bfloat16"  # a bf16 checkpoint there
    assert auto_kv_cache_dtype("auto", "auto", "float32", "float32") == "auto"  # a float32 checkpoint
    assert auto_kv_cache_dtype("auto", "auto", "float32", None) == "auto"  # a config that names no dtype
    assert auto_kv_cache_dtype("auto", "float32", "float32", "float16") == "auto"  # float32 asked for
    assert auto_kv_cache_dtype("auto", "float", "float32", "bfloat16") == "auto"
    assert auto_kv_cache_dtype("auto", "float16", "float32", "float32") == "float16"  # half asked for
    assert auto_kv_cache_dtype("auto", "half", "float32", None) == "float16"
    assert auto_kv_cache_dtype("auto", "auto", "bfloat16", "float16") == "auto"  # a bf16 run: its own cache
    assert auto_kv_cache_dtype("int8", "auto", "float32", "float16") == "int8"  # named: as named
    assert auto_kv_cache_dtype("bfloat16", "float32", "float32", "float32") == "bfloat16"


def test_a_checkpoints_dtype_is_read_as_vllm_reads_it(tmp_path) -> None:
    import json

    from tokenloom.model.loader import checkpoint_float_dtype, resolve_model_path

    assert checkpoint_float_dtype(resolve_model_path(None)) == "float16"  # a GGUF
    for cfg, want in (({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"),
                      ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"), ({}, None),
                      ({"torch_dtype": "int8"}, None)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
        assert checkpoint_float_dtype(tmp_path) == want, cfg


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=11))


@pytest.fixture(scope="module")
def tiny_d64(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("d64"), arch="llama", seed=5, head_dim=64))


@pytest.mark.parametrize("kvd", ["float16", "bfloat16"])
def test_pool_holds_twice_the_blocks_of_float32(tiny_d64, kvd) -> None:
    """At the same --kv-cache-memory a float32 run's 16-bit pool holds twice its float32 pool's blocks, in
    tensors of that type."""
    blocks = {}
    for name in ("auto", kvd):
        llm = LLM(tiny_d64, dtype="float32", kv_cache_dtype=name, kv_cache_memory=4 << 20, max_model_len=256)
        try:
            blocks[name] = llm.llm_engine.cache_config.num_blocks
            caches = llm.llm_engine.runner.kv_caches
            assert caches[0][0].dtype == (torch.float32 if name == "auto" else getattr(torch, kvd))
            assert sum(t.numel() * t.element_size() for layer in caches for t in layer) <= 4 << 20
        finally:
            _close(llm)
    assert blocks[kvd] / blocks["auto"] == pytest.approx(2.0, rel=0.02)


def test_the_default_engine_keeps_a_16bit_models_cache_16bit(tiny_d64) -> None:
    """The default model (a GGUF) under --dtype auto: where that runs float32 (no AVX512-BF16 / AMX) the cache is
    float16, twice a float32 cache's blocks in the same memory, and --dtype float32 keeps a float32 cache; where
    it runs bf16 the cache is the run's. A float32 checkpoint keeps a float32 cache under auto."""
    from tokenloom.model.platform import resolve_dtype

    float32_run = resolve_dtype("auto", torch.device("cpu")) == torch.float32
    found = {}
    for name, kw in (("auto", {}), ("float32", {"dtype": "float32"})):
        llm = LLM(kv_cache_memory=64 << 20, max_model_len=256, **kw)
        try:
            runner = llm.llm_engine.runner
            found[name] = (runner.kv_cache_dtype, runner.kv_caches[0][0].dtype, llm.llm_engine.cache_config.num_blocks)
            assert llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4),
                                use_tqdm=False)[0].outputs[0].token_ids
        finally:
            _close(llm)
    assert found["float32"][:2] == ("auto", torch.float32)
    if float32_run:
        assert found["auto"][:2] == ("float16", torch.float16)
        assert found["auto"][2] / found["float32"][2] == pytest.approx(2.0, rel=0.02)
    else:
        assert found["auto"][0] == "auto"
    llm = LLM(tiny_d64, num_blocks=16, max_model_len=64)  # its config.json: torch_dtype float32
    try:
        assert llm.llm_engine.runner.kv_cache_dtype == "auto"
    finally:
        _close(llm)


@needs_kernels
def test_naming_the_run_dtype_is_auto(tiny_d64) -> None:
    """--kv-cache-dtype bfloat16 under a bf16 run is the run dtype's cache: the same runner choices (the
    packed layout where the CPU has it) as auto, and float16 under bf16 a 16-bit cache of its own."""
    layouts = {}
    for name in ("auto", "bfloat16", "float16"):
        llm = LLM(tiny_d64, dtype="bfloat16", kv_cache_dtype=name, num_blocks=32, max_model_len=256)
        try:
            runner = llm.llm_engine.runner
            layouts[name] = (runner.kv_cache_dtype, runner.kv_caches[0][0].dtype, runner.attn_backend.kv_packed)
            llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        finally:
            _close(llm)
    assert layouts["bfloat16"] == layouts["auto"] and layouts["auto"][:2] == ("auto", torch.bfloat16)
    assert layouts["float16"] == ("float16", torch.float16, False)


@pytest.mark.slow
def test_greedy_agreement_with_float32_kv_on_the_default_model(capsys) -> None:
    """SmolLM2 GGUF, float32 (the AVX2 default): a float16 cache's greedy tokens against the float32 cache's
    (prefill through the kernel, decodes through the fused decode step). Free-running agreement is reported
    (the quantized path rounds each linear's input to int8, so a one-ulp change can move a near-tie); the
    claim is teacher-forced: scoring the float32 run's prompt + outputs with the float16 cache, its token is
    the top-1 at >= 95 % of the generated positions (189/192 on the Zen 1 EPYC) and each prompt's first token
    is the same."""
    against_the_float32_cache("float16", torch.float16, 0.95, capsys)


@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_prefix_caching_and_preemption_read_the_same_blocks(tiny_llama, path, monkeypatch) -> None:
    """A prompt served again from cached float16 blocks, and requests preempted and recomputed in a pool too
    small for all of them, give the tokens of the roomy, uncached float16 run."""
    if path == "kernels" and K is None:
        pytest.skip("compiled CPU kernels unavailable")
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "1" if path == "kernels" else "0")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    shared = [7, 3, 9, 11, 2, 5, 8, 13, 21, 34, 1, 4, 6, 10, 12, 14, 15, 16]
    prompts = [shared + [20 + i] for i in range(4)]
    want, _ = _tiny_run(tiny_llama, prompts, params, enable_prefix_caching=False, kv_cache_dtype="float16")
    cached, sched = _tiny_run(tiny_llama, prompts, params, kv_cache_dtype="float16")
    assert sched.kv_cache_manager.prefix_cache_totals.hits > 0 and cached == want
    small, sched = _tiny_run(tiny_llama, prompts, params, enable_prefix_caching=False, num_blocks=24,
                             kv_cache_dtype="float16")
    assert sched.num_preemptions_total > 0 and small == want


def test_speculative_and_async_scheduling_combine(tiny_llama) -> None:
    """n-gram drafts (verification rows read the 16-bit cache, rejected drafts' slots rewritten) and async
    scheduling give the plain float16-cache run's greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype="float16")
    both, sched = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype="float16", speculative_config=NGRAM,
                            async_scheduling=True)
    assert sched.spec_decoding_totals is not None and sched.spec_decoding_totals.num_accepted_tokens > 0
    assert both == want


@pytest.mark.slow
@pytest.mark.timeout(600)  # worker start-up on a loaded 2-core machine
@pytest.mark.parametrize("kvd, layout", [
    ("float16", {"tensor_parallel_size": 2}), ("int8", {"tensor_parallel_size": 2}),
    ("float16", {"pipeline_parallel_size": 2})], ids=["tp2-fp16", "tp2-int8", "pp2-fp16"])
def test_model_parallel_workers_take_the_option(tiny_llama, kvd, layout) -> None:
    """Two tensor-parallel workers, each caching its KV heads in the cache dtype (int8 with its scales per
    token and head, which each rank's heads carry whole), and two pipeline stages, each its layers': the
    one-rank engine's greedy tokens with that cache (float32 weights: the all-reduce's summation order
    cannot flip a greedy choice here)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want, _ = _tiny_run(tiny_llama, TINY_PROMPTS, params, kv_cache_dtype=kvd)
    llm = LLM(tiny_llama, kv_cache_dtype=kvd, **layout, **TINY)
    try:
        info = llm.llm_engine.executor.worker_info
        outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params, use_tqdm=False)
    finally:
        llm.llm_engine.close()
    assert [i["kv_cache_dtype"] for i in info] == [kvd, kvd]
    assert [list(o.outputs[0].token_ids) for o in outs] == want


@pytest.mark.parametrize("kvd", ["float16", "int8"])
def test_offloading_tier_stores_and_serves_the_cache_dtype(tiny_llama, kvd) -> None:
    """The KV offloading connector copies a block's bytes whatever they hold: a prompt evicted into the host
    tier comes back as hits (its blocks of a float16 cache, or int8 values with their scales) and gives the
    tokens of the run without a connector."""
    from tests.test_kv_offload import BS, EXPECTED_HIT, GREEDY, PROMPT, _run

    kw = dict(dtype="float32", block_size=BS, kv_cache_dtype=kvd)
    plain = LLM(tiny_llama, num_blocks=256, **kw)
    try:
        want = _run(plain, PROMPT)[0]
    finally:
        _close(plain)
    llm = LLM(tiny_llama, num_blocks=32, kv_offloading_size=0.01, **kw)
    try:
        assert _run(llm, PROMPT) == (want, 0)
        assert llm.llm_engine.scheduler.reset_prefix_cache()
        assert _run(llm, PROMPT, GREEDY) == (want, EXPECTED_HIT)
    finally:
        llm.llm_engine.close()
