"""The compiled CPU kernels (tokenloom/model/csrc/cpu_kernels.cpp) against the pure-torch path.

Random paged caches with odd context lengths, block sizes 1 / 16 (and 5), GQA 3:1 (and 1:1, 2:1, 4:1),
fp32 and bf16, the plain and the packed (bf16) KV layouts, SIMD and plain-loop code, decodes mixed
with prefill chunks that continue a cached prefix; the elementwise
kernels (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary + KV write) against their torch
equivalents; and a failed build falling back to the torch path with a warning.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model import kernels as kernels_mod
from tokenloom.model.attention import (
    DecodeMetadata,
    KernelMetadata,
    PrefillMetadata,
    TorchAttentionMetadata,
    causal_offset_mask,
    pack_kv_layout,
    paged_attention,
    paged_attention_fused,
    write_kv,
)
from tokenloom.model.config import ModelConfig
from tokenloom.model.rotary import RotaryEmbedding

K = kernels_mod.cpu_kernels()
HAVE_TOOLCHAIN = all(shutil.which(tool) for tool in ("c++", "ninja"))
needs_kernels = pytest.mark.skipif(K is None, reason="compiled CPU kernels unavailable on this machine")


def test_kernels_build_where_a_toolchain_exists() -> None:
    """Guards the skips below: with a compiler and ninja present, a broken source is a failure."""
    if not HAVE_TOOLCHAIN or not kernels_mod.enabled_by_env():
        pytest.skip("no C++ toolchain (or TOKENLOOM_CPU_KERNELS=0): the torch path is the tested one")
    assert K is not None, "the CPU kernels failed to build: see the warning in the log"

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _case(seed: int, dtype: torch.dtype, block_size: int, hq: int, hkv: int, d: int,
          seqs: list[tuple[int, int]]):  # fmt: skip
    """seqs: (start, num_tokens) per sequence. Returns a random cache, q/k/v of the step, tables."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(s + n) // block_size) for s, n in seqs)
    num_blocks = len(seqs) * max_blocks + 3
    k_cache = torch.randn(hkv, num_blocks, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(hkv, num_blocks, block_size, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # scattered blocks
    tables = [perm[i * max_blocks : (i + 1) * max_blocks].tolist() for i in range(len(seqs))]
    total = sum(n for _, n in seqs)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=g).to(dtype)
    return k_cache, v_cache, tables, qkv


def _slots(tables, seqs, block_size):
    out = []
    for table, (s, n) in zip(tables, seqs):
        out += [table[p // block_size] * block_size + p % block_size for p in range(s, s + n)]
    return torch.tensor(out, dtype=torch.long)


def _kernel_meta(tables, seqs):
    q_start = [0]
    for _, n in seqs:
        q_start.append(q_start[-1] + n)
    return KernelMetadata(
        block_tables=torch.tensor(tables, dtype=torch.int32),
        q_start=torch.tensor(q_start, dtype=torch.int32),
        pos_start=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
    )


def _torch_meta(tables, seqs, block_size, slots):
    """The pure-torch path's metadata: all decodes (num_tokens == 1) must come first."""
    decodes, prefills, offset = [], [], 0
    dec = [(i, s) for i, (s, n) in enumerate(seqs) if n == 1]
    if dec:
        max_blocks = max(s // block_size + 1 for _, s in dec)
        bt = torch.zeros(len(dec), max_blocks, dtype=torch.long)
        bias = torch.full((1, len(dec), 1, max_blocks * block_size), float("-inf"))
        for j, (i, s) in enumerate(dec):
            nb = s // block_size + 1
            bt[j, :nb] = torch.tensor(tables[i][:nb])
            bias[0, j, 0, : s + 1] = 0.0
        decodes.append(DecodeMetadata(0, len(dec), bt.reshape(-1), max_blocks, bias))
        offset = len(dec)
    for i, (s, n) in enumerate(seqs):
        if n == 1:
            continue
        nb = -(-(s + n) // block_size)
        mask = causal_offset_mask(s, n, "cpu") if s > 0 else None
        prefills.append(PrefillMetadata(offset, n, s + n, torch.tensor(tables[i][:nb]), mask))
        offset += n
    return TorchAttentionMetadata(slot_mapping=slots, decodes=decodes, prefills=prefills)


def _dense_reference(qkv, k_cache, v_cache, tables, seqs, hq, hkv, d):
    """fp64 attention over gathered contexts: the ground truth both paths are held to."""
    block_size = k_cache.shape[2]
    out, row = [], 0
    for table, (s, n) in zip(tables, seqs):
        ctx = s + n
        pos = torch.arange(ctx)
        idx = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = k_cache.reshape(hkv, -1, d)[:, idx].double().repeat_interleave(hq // hkv, 0)  # [Hq, ctx, D]
        v = v_cache.reshape(hkv, -1, d)[:, idx].double().repeat_interleave(hq // hkv, 0)
        q = qkv[row : row + n, : hq * d].double().view(n, hq, d).transpose(0, 1)  # [Hq, n, D]
        scores = q @ k.transpose(1, 2) * d**-0.5
        visible = pos[None, :] <= (s + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, hq * d))
        row += n
    return torch.cat(out)


# Decodes first (the torch path's layout), then prefill chunks: from 0, and continuing a prefix.
SEQS = [(0, 1), (16, 1), (37, 1), (300, 1), (5, 1), (0, 23), (41, 17), (15, 2), (64, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 48), (4, 2, 16), (3, 1, 12)],
                         ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@needs_kernels
@pytest.mark.parametrize("force_scalar", [False, True], ids=["simd", "scalar"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_fused_attention_matches_torch_path(dtype, block_size, heads, force_scalar, packed) -> None:
    hq, hkv, d = heads
    if packed and not (dtype == torch.bfloat16 and K.packed_layout_supported(block_size, d)):
        pytest.skip("the packed layout is for bf16, block_size % 16 == 0, head_dim % 32 == 0 on AVX512-BF16")
    k_cache, v_cache, tables, qkv = _case(7, dtype, block_size, hq, hkv, d, SEQS)
    slots = _slots(tables, SEQS, block_size)
    q = qkv[:, : hq * d].view(-1, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(-1, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(-1, hkv, d)
    write_kv((k_cache, v_cache), k, v, slots)  # what rotary_and_cache does in the fused path
    cache = pack_kv_layout(k_cache, v_cache) if packed else (k_cache, v_cache)
    K.set_force_scalar(force_scalar)
    try:
        fused = paged_attention_fused(K, qkv, hq, cache, _kernel_meta(tables, SEQS), packed)
    finally:
        K.set_force_scalar(False)
    reference = _dense_reference(qkv, k_cache, v_cache, tables, SEQS, hq, hkv, d)
    torch.testing.assert_close(fused.double(), reference, **TOL[dtype])
    plain = paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()), _torch_meta(tables, SEQS, block_size, slots))
    # The torch path rounds scores and probabilities to bf16; the kernel keeps them in fp32.
    torch.testing.assert_close(fused.float(), plain.float(), **TOL[dtype])


# The three KV layouts; the packed one runs where the CPU has AVX512-BF16 and is a visible skip elsewhere
# (it was a silent `continue` inside each test).
LAYOUTS = pytest.mark.parametrize("dtype, packed", [(torch.float32, False), (torch.bfloat16, False),
                                                    (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-packed"])


def _skip_unless_packed_runs(packed: bool, block_size: int = 16, head_dim: int = 64) -> None:
    if packed and not K.packed_layout_supported(block_size, head_dim):
        pytest.skip("the packed layout is for bf16, block_size % 16 == 0, head_dim % 32 == 0 on AVX512-BF16")


@needs_kernels
@LAYOUTS
def test_long_context_and_many_sequences(dtype, packed) -> None:
    """Contexts past the 16-key tiles' and the scratch buffers' first sizes; all threads busy."""
    _skip_unless_packed_runs(packed)
    seqs = [(int(s), 1) for s in torch.randint(0, 1500, (40,), generator=torch.Generator().manual_seed(3))]
    seqs += [(1000, 64), (0, 300)]
    k_cache, v_cache, tables, qkv = _case(11, dtype, 16, 9, 3, 64, seqs)
    cache = pack_kv_layout(k_cache, v_cache) if packed else (k_cache, v_cache)
    fused = paged_attention_fused(K, qkv, 9, cache, _kernel_meta(tables, seqs), packed)
    reference = _dense_reference(qkv, k_cache, v_cache, tables, seqs, 9, 3, 64)
    torch.testing.assert_close(fused.double(), reference, **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("heads", [(14, 2, 64), (9, 3, 64), (8, 8, 40)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_long_prefill_chunks_match_reference(dtype, block_size, heads) -> None:
    """Long prefill chunks (the tiled kernel: many 16-row query tiles x 32-key tiles, a partial last
    tile of each, GQA groups of 7, 3 and 1): a first chunk, one continuing 700 cached tokens, and a
    decode beside them, against fp64 attention; the plain loops agree too."""
    hq, hkv, d = heads
    seqs = [(700, 1), (0, 203), (700, 150)]
    k_cache, v_cache, tables, qkv = _case(13, dtype, block_size, hq, hkv, d, seqs)
    meta = _kernel_meta(tables, seqs)
    fused = paged_attention_fused(K, qkv, hq, (k_cache, v_cache), meta, False)
    reference = _dense_reference(qkv, k_cache, v_cache, tables, seqs, hq, hkv, d)
    torch.testing.assert_close(fused.double(), reference, **TOL[dtype])
    K.set_force_scalar(True)
    try:
        scalar = paged_attention_fused(K, qkv, hq, (k_cache, v_cache), meta, False)
    finally:
        K.set_force_scalar(False)
    torch.testing.assert_close(fused.float(), scalar.float(), **TOL[dtype])


@needs_kernels
def test_large_scores_do_not_overflow() -> None:
    seqs = [(40, 1), (0, 9)]
    k_cache, v_cache, tables, qkv = _case(5, torch.float32, 16, 3, 1, 64, seqs)
    k_cache.mul_(30.0)
    qkv.mul_(30.0)
    fused = paged_attention_fused(K, qkv, 3, (k_cache, v_cache), _kernel_meta(tables, seqs), False)
    assert torch.isfinite(fused).all()
    reference = _dense_reference(qkv, k_cache, v_cache, tables, seqs, 3, 1, 64)
    torch.testing.assert_close(fused.double(), reference, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- elementwise kernels


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [576, 64, 37])
def test_rms_norm_kernels(dtype, hidden) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(33, hidden, generator=g) * 3).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    out = torch.empty_like(x)
    K.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), w, 1e-5), **TOL[dtype])

    residual = (torch.randn(33, hidden, generator=g) * 2).to(dtype)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (hidden,), w, 1e-5)
    K.fused_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # same rounding as torch's add
    torch.testing.assert_close(x, expected, **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inter", [1536, 40, 7])
def test_silu_and_mul(dtype, inter) -> None:
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(19, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    out = torch.empty(19, inter, dtype=dtype)
    K.silu_and_mul(out, gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (2, 1, 40)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_rotary_and_cache(dtype, heads, packed) -> None:
    hq, hkv, d = heads
    if packed and not (dtype == torch.bfloat16 and K.packed_layout_supported(16, d)):
        pytest.skip("the packed layout is for bf16, block_size % 16 == 0, head_dim % 32 == 0 on AVX512-BF16")
    config = ModelConfig("llama", vocab_size=32, hidden_size=hq * d, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
    rope = RotaryEmbedding(config, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(d)
    t, block_size, num_blocks = 21, 16, 8
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 700, (t,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[3] = -1  # padding slot: skipped
    k_cache = torch.zeros(hkv, num_blocks, block_size, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    cos, sin = rope.tables(positions, int(positions.max()))
    qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    expected_k = torch.zeros_like(k_cache)
    expected_v = torch.zeros_like(v_cache)
    keep = slots >= 0
    write_kv((expected_k, expected_v), qk[keep, hq:], qkv[keep, (hq + hkv) * d :].view(-1, hkv, d), slots[keep])

    cos_t, sin_t = rope.full_tables(int(positions.max()))
    fused = qkv.clone()
    K.rotary_and_cache(fused, positions, cos_t, sin_t, hq, k_cache, v_cache, slots, packed)
    if packed:
        expected_k, expected_v = pack_kv_layout(expected_k, expected_v)
    # torch rounds each product to bf16; the kernel rounds once.
    torch.testing.assert_close(fused[:, : (hq + hkv) * d].view(t, hq + hkv, d), qk, **TOL[dtype])
    torch.testing.assert_close(fused[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :], atol=0, rtol=0)
    torch.testing.assert_close(k_cache, expected_k, **TOL[dtype])
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


# --------------------------------------------------------------------------- fallback


def test_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog) -> None:
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(kernels_mod, "SOURCE", bad)
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels_mod, "_state", {"tried": False, "module": None, "build_s": None})
    with caplog.at_level(logging.WARNING, logger="tokenloom.model.kernels"):
        assert kernels_mod.cpu_kernels() is None
    assert any("pure-torch path" in r.getMessage() for r in caplog.records)
    assert kernels_mod.cpu_kernels() is None  # not retried


def test_disabled_by_env(monkeypatch) -> None:
    monkeypatch.setenv("TOKENLOOM_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels_mod, "_state", {"tried": False, "module": None, "build_s": None})
    assert kernels_mod.cpu_kernels() is None


# --------------------------------------------------------------------------- the runner, end to end


def _generate(runner, prompts: dict[str, list[int]], block_size: int, max_tokens: int = 6):
    """Drive `runner` with the real scheduler (chunked prefill, prefix hits, a tight pool)."""
    from tokenloom.config import CacheConfig, SchedulerConfig
    from tokenloom.core.request import Request
    from tokenloom.core.scheduler import Scheduler
    from tokenloom.sampling_params import SamplingParams

    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=block_size, num_blocks=runner.num_blocks, enable_prefix_caching=True),
        clock=lambda: 0.0,
    )
    for rid, p in prompts.items():
        sched.add_request(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    while sched.has_requests():
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute_model(so)):
            assert out.error is None
            generated[out.request_id] += out.new_token_ids
    return generated


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_fused_path_generates_like_transformers(tmp_path, dtype) -> None:
    """head_dim 64 and block size 16 (so bf16 runs the packed layout), GQA 2:1: greedy tokens equal
    transformers' (fp32), or the torch path's (bf16); the last-layer row pruning is exercised by
    every step with a prefill chunk."""
    from tests.tiny_models import make_tiny_hf_model
    from tokenloom.model.loader import load_model
    from tokenloom.model.runner import ModelRunner

    path = make_tiny_hf_model(tmp_path, arch="llama", seed=4, head_dim=64)  # 4 q heads, 2 kv heads
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 300, (21,), generator=g).tolist()
    prompts = {f"r{i}": shared + torch.randint(3, 300, (5 + 7 * i,), generator=g).tolist() for i in range(4)}
    prompts["solo"] = torch.randint(3, 300, (40,), generator=g).tolist()
    loaded = load_model(path, getattr(torch, dtype))
    fused = ModelRunner(loaded, block_size=16, num_blocks=24, dtype=dtype, device="cpu", cpu_kernels=True)
    assert fused.model.kv_packed == (dtype == "bfloat16" and K.packed_layout_supported(16, 64))
    got = _generate(fused, prompts, 16)
    if dtype == "float32":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        for rid, p in prompts.items():
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
            assert got[rid] == ref, rid
    else:
        plain = ModelRunner(loaded, block_size=16, num_blocks=24, dtype=dtype, device="cpu", cpu_kernels=False)
        expected = _generate(plain, prompts, 16)
        # bf16 rounding differs between the paths (the kernels round once); random tiny weights have
        # well-separated logits, so the greedy tokens agree.
        assert got == expected


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_rows_equals_torch(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 1003, generator=g).to(dtype)
    logits[3, 10] = logits[3, 500] = 50.0  # tie: the first index wins, as in torch
    logits[4] = -torch.inf
    logits[5, -1] = 100.0  # the maximum in the tail
    logits[6, 7] = torch.nan  # NaN rows are left to the caller (-1)
    got = K.argmax_rows(logits)
    expected = logits.float().argmax(dim=-1)
    assert got[6] == -1
    keep = torch.arange(37) != 6
    assert torch.equal(got[keep], expected[keep])


@needs_kernels
@LAYOUTS
def test_unwritten_slots_never_reach_the_result(dtype, packed) -> None:
    """The fused path's KV cache is not zeroed: NaN in every slot past a row's context (within its
    blocks) must not change anything."""
    _skip_unless_packed_runs(packed)
    seqs = [(20, 1), (0, 7), (33, 3)]
    k_cache, v_cache, tables, qkv = _case(9, dtype, 16, 6, 2, 64, seqs)
    meta = _kernel_meta(tables, seqs)
    cache = pack_kv_layout(k_cache, v_cache) if packed else (k_cache, v_cache)
    clean = paged_attention_fused(K, qkv, 6, cache, meta, packed)
    for table, (s, n) in zip(tables, seqs):  # poison the tail of each sequence's last block
        for pos in range(s + n, -(-(s + n) // 16) * 16):
            k_cache[:, table[pos // 16], pos % 16] = float("nan")
            v_cache[:, table[pos // 16], pos % 16] = float("nan")
    cache = pack_kv_layout(k_cache, v_cache) if packed else (k_cache, v_cache)
    poisoned = paged_attention_fused(K, qkv, 6, cache, meta, packed)
    assert torch.equal(clean, poisoned), (dtype, packed)
