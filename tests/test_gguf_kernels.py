"""The GGUF kernels (tokenloom/model/csrc/gguf_kernels.cpp) against gguf's reference dequantization.

Random blocks of every type (random bytes, with the float16 scale fields set to sane values), odd
row counts, token counts that exercise every tail of the four-token tiling, both activation dtypes,
the SIMD and the plain C++ paths. The oracle for `gguf_linear` is gguf.quants.dequantize(W) times the
activations after the kernel's own int8 quantization (groups of 32, d = max|x| / 127, round half to
even), computed here in torch: they must agree to float summation error. A second, looser check
against the unquantized activations bounds what that quantization costs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from tokenloom.model.gguf_kernels import gguf_kernels

Q = GGMLQuantizationType
# Byte offsets of each type's float16 fields (d, and m / dmin where there is one).
F16_FIELDS = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0],
}  # fmt: skip
TYPES = list(F16_FIELDS)
# The types with an 8-row layout (gguf_repack8), and of those the K-quants (tiles of 256 columns).
PACKED_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
K_TILED = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
# Bytes of a repacked tile group against the file's 8 blocks: the six-bit scales (and mins) unpacked.
PACKED_GROWTH = {Q.Q3_K: (912, 880), Q.Q4_K: (1184, 1152), Q.Q5_K: (1440, 1408), Q.IQ4_XS: (1104, 1088)}

kernels = gguf_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="GGUF kernels unavailable (no compiler)")


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row_bytes] uint8 of random blocks whose float16 fields are small normal numbers."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((n, k // block)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 per group of 32 with d = max|x| / 127, dequantized (fp32)."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv)
    return (q * (amax / 127.0)).reshape(x.shape)


def shapes(qtype: Q) -> list[tuple[int, int]]:
    block = GGML_QUANT_SIZES[qtype][0]
    return [(1, block), (7, 3 * block), (33, 2 * block)] if block == 256 else [(1, 32), (7, 96), (33, 608)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype: Q) -> None:
    for i, (n, k) in enumerate(shapes(qtype)):
        raw = random_blocks(qtype, n, k, seed=i)
        want = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
        got = torch.empty(n, k)
        kernels.gguf_dequantize(got, torch.from_numpy(raw), int(qtype))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        ids = torch.tensor([n - 1, 0, n // 2], dtype=torch.int64)
        rows = torch.empty(3, k, dtype=torch.bfloat16)
        kernels.gguf_embedding(rows, torch.from_numpy(raw), int(qtype), ids)
        torch.testing.assert_close(rows, want[ids].to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_matches_reference(qtype: Q, scalar: bool) -> None:
    kernels.set_force_scalar(scalar)
    try:
        for i, (n, k) in enumerate(shapes(qtype)):
            raw = random_blocks(qtype, n, k, seed=10 + i)
            w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(i))
            for m in (1, 3, 6):  # tails of the four-token tiling: 1, 3, 4 + 2
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 * m + i)).to(dtype)
                    out = torch.empty(m, n, dtype=dtype)
                    kernels.gguf_linear(out, x, torch.from_numpy(raw), int(qtype), bias)
                    want = quantized_activations(x).double() @ w.double().T + bias.double()
                    scale = (x.float().abs() @ w.abs().T).double() + bias.abs().double() + 1e-3  # the sums' size
                    err = ((out.double() - want).abs() / scale).max().item()
                    limit = 1e-5 if dtype == torch.float32 else 4e-3  # bf16: the output's rounding
                    assert err < limit, f"{qtype.name} n={n} k={k} m={m} {dtype}: error {err:.2e}"
                    # Against the unquantized activations: the int8 rounding stays small.
                    exact = x.double() @ w.double().T + bias.double()
                    assert ((out.double() - exact).abs() / scale).max().item() < 2e-2
    finally:
        kernels.set_force_scalar(False)


def test_bad_input_is_rejected() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 4, 64, seed=0))
    with pytest.raises(RuntimeError, match="row"):
        kernels.gguf_linear(torch.empty(1, 4), torch.randn(1, 96), raw, int(Q.Q4_1), None)
    with pytest.raises(RuntimeError, match="no tokenloom kernel"):
        kernels.gguf_linear(torch.empty(1, 4), torch.randn(1, 64), raw, int(Q.F16), None)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gguf_embedding(torch.empty(1, 64), raw, int(Q.Q4_1), torch.tensor([4]))


def _vma_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                lo, hi = (int(v, 16) for v in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")
def test_repacked_weights_share_huge_page_chunks() -> None:
    """Repacked weights live in chunks that start on a 2 MiB boundary, madvised for huge pages; small ones are
    carved one after another (64-byte aligned, nothing rounded up to 2 MiB); a chunk goes with its last weight.
    Independent of what other tests left alive: a weight above the 64 MiB chunk size always opens its own."""
    big = kernels.gguf_repack8(torch.zeros(64, 34 * 31_000, dtype=torch.uint8), int(Q.Q8_0), 32 * 31_000)  # 67 MB
    base = big.data_ptr()
    assert base % (2 << 20) == 0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _vma_flags(base).get("THPeligible") == "1"
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 64, 96, seed=5))
    first = kernels.gguf_repack8(raw, int(Q.Q4_1), 96)
    second = kernels.gguf_repack8(raw, int(Q.Q4_1), 96)
    assert second.data_ptr() == first.data_ptr() + (first.numel() + 63) // 64 * 64  # the next 64-byte boundary
    assert first.data_ptr() % 64 == 0 and torch.equal(first, second)
    want, got = torch.empty(64, 96), torch.empty(64, 96)
    kernels.gguf_dequantize(want, raw, int(Q.Q4_1))
    kernels.gguf_dequantize_packed(got, second, int(Q.Q4_1))
    assert torch.equal(got, want)
    del big, first, second  # the big one's chunk (and the small ones', which fit in its tail) is returned
    assert _vma_flags(base).get("THPeligible") is None


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_packed_layout_matches_rows(qtype: Q, scalar: bool) -> None:
    """The 8-row interleaved layout (gguf_repack8 + gguf_linear_packed) computes what the row kernel does."""
    kernels.set_force_scalar(scalar)
    try:
        n, k = (24, 512) if qtype in K_TILED else (24, 96)
        raw = torch.from_numpy(random_blocks(qtype, n, k, seed=3))
        packed = kernels.gguf_repack8(raw, int(qtype), k)
        # Same bytes, reordered; the K-quants' and IQ4_XS's six-bit scales (and mins) unpacked to bytes.
        grown, file = PACKED_GROWTH.get(qtype, (1, 1))
        assert packed.numel() == raw.numel() * grown // file
        want_w, got_w = torch.empty(n, k), torch.empty(n, k)
        kernels.gguf_dequantize(want_w, raw, int(qtype))
        kernels.gguf_dequantize_packed(got_w, packed, int(qtype))
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
        bias = torch.randn(n)
        for m in (1, 3, 6, 41):  # 41: a prefill-sized batch, tiles outer and rows inner
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            want, got = torch.empty(m, n), torch.empty(m, n)
            kernels.gguf_linear(want, x, raw, int(qtype), bias)
            kernels.gguf_linear_packed(got, x, packed, int(qtype), bias)
            # Float sums in another order: within 1e-5 of the sums' size (K-quants reach ~100s).
            size = float((x.abs() @ want_w.abs().T).max())
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(size, 1.0))
    finally:
        kernels.set_force_scalar(False)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_packed_tiles_shared_out_between_threads(qtype: Q) -> None:
    """However the tiles are split between threads (run_packed), every tile is computed exactly once and
    each row by one thread whole, so two or three threads give one thread's result bit for bit."""
    n, k = 8 * 203, 256  # an odd number of tiles, more than one chunk each
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=5))
    packed = kernels.gguf_repack8(raw, int(qtype), k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    want = torch.empty(1, n)
    kernels.gguf_linear(want, x, raw, int(qtype), None)
    threads = torch.get_num_threads()
    outs = []
    try:
        for nth in (1, 2, 3):
            torch.set_num_threads(nth)
            got = torch.full((1, n), float("nan"))
            kernels.gguf_linear_packed(got, x, packed, int(qtype), None)
            outs.append(got)
    finally:
        torch.set_num_threads(threads)
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0], want, rtol=0, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
def test_the_weight_prefetch_stages_change_no_output(qtype: Q) -> None:
    """The tile kernels' prefetch (none, one stage or two: the plan's choice by CPU vendor) is hints only:
    all give the same outputs bit for bit, at decode and at few-row widths; any other stage count is refused."""
    n, k = 8 * 37, 512
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=17))
    packed = kernels.gguf_repack8(raw, int(qtype), k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    before = kernels.weight_prefetch_stages()
    outs = {}
    try:
        for stages in (0, 1, 2):
            kernels.set_weight_prefetch_stages(stages)
            assert kernels.weight_prefetch_stages() == stages
            for m in (1, 3):
                outs[stages, m] = torch.full((m, n), float("nan"))
                kernels.gguf_linear_packed(outs[stages, m], x[:m], packed, int(qtype), None)
        for bad in (3, -1):
            with pytest.raises(RuntimeError, match="must be 0, 1 or 2"):
                kernels.set_weight_prefetch_stages(bad)
    finally:
        kernels.set_weight_prefetch_stages(before)
    for m in (1, 3):
        assert not outs[0, m].isnan().any()
        torch.testing.assert_close(outs[1, m], outs[0, m], rtol=0, atol=0)
        torch.testing.assert_close(outs[2, m], outs[0, m], rtol=0, atol=0)


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "plain"])
def test_stolen_tiles_are_computed_once_and_alike(scalar: bool) -> None:
    """Work stealing (TileCursor, gguf_quants.h): four threads on this machine's cores start and run
    unevenly, so threads that end their own tiles take the back half of another's. Whoever computes
    a tile, the result is one thread's result bit for bit and no tile is left out (the output starts
    as NaN); the steal counter shows stealing did run."""
    qtype = Q.Q4_K
    n, k = 8 * 401, 512
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=11))
    packed = kernels.gguf_repack8(raw, int(qtype), k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    kernels.set_force_scalar(scalar)
    try:
        torch.set_num_threads(1)
        want = torch.empty(2, n)
        kernels.gguf_linear_packed(want, x, packed, int(qtype), None)
        torch.set_num_threads(4)
        steals = kernels.tile_steals()
        for _ in range(40 if scalar else 200):
            got = torch.full((2, n), float("nan"))
            kernels.gguf_linear_packed(got, x, packed, int(qtype), None)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            if kernels.tile_steals() > steals + 20:
                break
        assert kernels.tile_steals() > steals, "no thread stole: the test did not exercise stealing"
    finally:
        torch.set_num_threads(threads)
        kernels.set_force_scalar(False)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_loader_dequantizes_every_kernel_type(qtype: Q) -> None:
    """Loading a GGUF dequantized (the default) handles the K-quants too, for every model family."""
    from tokenloom.model.gguf import GGUFTensor, dequantize

    n, k = shapes(qtype)[1]
    raw = random_blocks(qtype, n, k, seed=5)
    got = dequantize(GGUFTensor(name="w", qtype=qtype, shape=(n, k), raw=raw.reshape(-1)))
    torch.testing.assert_close(got, torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_embedding_rows_from_the_packed_layout(qtype: Q) -> None:
    """A tied embedding reads its rows from the LM head's 8-row copy: the same values as the file's rows."""
    n, k = (24, 512) if qtype in K_TILED else (24, 96)
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=11))
    packed = kernels.gguf_repack8(raw, int(qtype), k)
    ids = torch.tensor([0, 7, 8, 23, 5, 5])
    for dtype in (torch.float32, torch.bfloat16):
        want, got = torch.empty(len(ids), k, dtype=dtype), torch.empty(len(ids), k, dtype=dtype)
        kernels.gguf_embedding(want, raw, int(qtype), ids)
        kernels.gguf_embedding_packed(got, packed, int(qtype), ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gguf_embedding_packed(torch.empty(1, k), packed, int(qtype), torch.tensor([n]))


def test_activation_quantizer_simd_matches_plain() -> None:
    """The AVX2 quantizer of the kernels' activations (int8 per 32, d = max|x| / 127) writes the same
    bytes, d, s and per-16 sums as the plain loop and as the torch oracle, ties rounded half to even."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 608, generator=gen) * torch.logspace(-3, 2, 5)[:, None]
    x[1, 32:64] = 0.0  # an all-zero group: d = 0, q = 0
    ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])
    x[2, 64:96] = ties.repeat(4)  # amax 127: x * 127 / amax are exact halves
    got = kernels.gguf_quantize_act(x)
    kernels.set_force_scalar(True)
    try:
        plain = kernels.gguf_quantize_act(x)
    finally:
        kernels.set_force_scalar(False)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    q, d, s, bs = got
    assert q[2, 64:72].tolist() == [127, 2, -4, 0, 0, 2, 126, -126]
    assert torch.equal((q.float().reshape(5, -1, 32) * d[..., None]).reshape(5, -1), quantized_activations(x))
    assert torch.allclose(s, d * q.float().reshape(5, -1, 32).sum(-1))
    assert torch.equal(bs, q.reshape(5, -1, 16).sum(-1, dtype=torch.int16))  # the per-16 sums Q6_K's tiles use


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_batched_gemm_matches_reference(qtype: Q, scalar: bool) -> None:
    """gguf_gemm_packed (the prefill GEMM: weights unpacked to int8 chunks on the fly, register-blocked
    rows x tile pairs) against the dequantized float reference on the kernel's own quantized
    activations, and against the small-batch kernel: row counts around the crossover and a prefill
    size (tails of the 2-row micro-kernel and of the row blocks), an odd number of 8-row tiles (a
    single-tile tail after the pairs), K spanning several unpacked chunks plus a partial one, bias."""
    kernels.set_force_scalar(scalar)
    try:
        kquant = qtype in K_TILED
        n, k = (40, 256 * 5) if kquant else (40, 32 * 37)  # 5 tiles; K = 2.5 / 2.3 chunks of 16 groups
        raw = torch.from_numpy(random_blocks(qtype, n, k, seed=7))
        packed = kernels.gguf_repack8(raw, int(qtype), k)
        w = torch.empty(n, k)
        kernels.gguf_dequantize(w, raw, int(qtype))
        bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
        rows = (1, 31, 32, 33, 100) if scalar else (1, 31, 32, 33, 100, 512)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            got, small = torch.empty(m, n), torch.empty(m, n)
            kernels.gguf_gemm_packed(got, x, packed, int(qtype), bias)
            want = quantized_activations(x).double() @ w.double().T + bias.double()
            scale = (x.abs() @ w.abs().T).double() + bias.abs().double() + 1e-3
            err = ((got.double() - want).abs() / scale).max().item()
            assert err < 1e-5, f"{qtype.name} m={m}: error {err:.2e}"
            kernels.gguf_linear_packed(small, x, packed, int(qtype), bias)
            size = float((x.abs() @ w.abs().T).max())
            torch.testing.assert_close(got, small, rtol=0, atol=1e-5 * max(size, 1.0))
        # Strided output (a part's columns of a fused linear's output), no bias.
        x = torch.randn(33, k, generator=torch.Generator().manual_seed(5))
        wide = torch.full((33, n + 16), 7.0)
        kernels.gguf_gemm_packed(wide[:, 8 : 8 + n], x, packed, int(qtype), None)
        want = quantized_activations(x).double() @ w.double().T
        scale = (x.abs() @ w.abs().T).double() + 1e-3
        assert ((wide[:, 8 : 8 + n].double() - want).abs() / scale).max().item() < 1e-5
        assert bool((wide[:, :8] == 7.0).all()) and bool((wide[:, 8 + n :] == 7.0).all())
    finally:
        kernels.set_force_scalar(False)


def test_gemm_crossover_follows_the_micro_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUFLinear's switch from the tile kernel to the batched GEMM sits where the build's GEMM
    overtakes it: 8 rows with the 512-bit micro-kernel (built exactly where AVX-512 VNNI is, TOKENLOOM_CPU_ISA
    capping), 64 with the 256-bit one; TOKENLOOM_GGUF_GEMM_ROWS overrides, a bad value is refused by name."""
    from tokenloom import cpu_isa
    from tokenloom.model.gguf_weights import GEMM_MIN_ROWS_NARROW, GEMM_MIN_ROWS_WIDE, gemm_min_rows

    monkeypatch.delenv("TOKENLOOM_GGUF_GEMM_ROWS", raising=False)
    wide = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_isa.cpu_flags()
    assert kernels.has_wide_gemm() == wide
    assert gemm_min_rows(kernels) == (GEMM_MIN_ROWS_WIDE if wide else GEMM_MIN_ROWS_NARROW)
    monkeypatch.setenv("TOKENLOOM_GGUF_GEMM_ROWS", "24")
    assert gemm_min_rows(kernels) == 24
    monkeypatch.setenv("TOKENLOOM_GGUF_GEMM_ROWS", "many")
    with pytest.raises(ValueError, match="TOKENLOOM_GGUF_GEMM_ROWS"):
        gemm_min_rows(kernels)


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_batched_gemm_pair_and_single_tile_paths_agree_bit_for_bit(qtype: Q) -> None:
    """The batched GEMM runs whole tile pairs through one micro-kernel (AVX-512: a pair per 64-byte
    register, signed types offset to unsigned bytes) and a last odd tile through another; both must
    compute the same integers and the same float formula. A weight whose third tile repeats its first
    must give those rows bit-identical outputs, at row counts that end inside each kernel's row block."""
    kquant = qtype in K_TILED
    k = 256 * 3 if kquant else 32 * 37
    raw = random_blocks(qtype, 24, k, seed=11)
    raw[16:24] = raw[0:8]
    packed = kernels.gguf_repack8(torch.from_numpy(raw), int(qtype), k)
    for m in (1, 5, 37):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
        got = torch.empty(m, 24)
        kernels.gguf_gemm_packed(got, x, packed, int(qtype), None)
        assert torch.equal(got[:, 16:24], got[:, 0:8]), f"{qtype.name} m={m}"
        assert not torch.equal(got[:, 8:16], got[:, 0:8])  # the middle tile is other weights


def extreme_blocks(qtype: Q, n: int, k: int) -> np.ndarray:
    """Blocks at the integer sums' limits: every quant at its maximum (Q2_K 3, Q4_K 15, Q5_K 31, Q6_K 63, Q3_K
    -4, IQ4_XS the level -127) and the sub-block scales at theirs (Q2_K scale and min 15, or one 15 and the
    other 0 in odd rows; Q4_K / Q5_K 63, Q6_K -128 in even rows and 127 in odd ones, Q3_K and IQ4_XS -32 and
    31)."""
    raw = random_blocks(qtype, n, k, seed=17).reshape(n, k // 256, -1)
    if qtype == Q.Q2_K:
        rows = np.arange(n)
        raw[:, :, 0:16] = np.where(rows % 2 == 0, 0xFF, np.where(rows % 4 == 1, 0x0F, 0xF0))[:, None, None]
        raw[:, :, 16:80] = 0xFF  # every quant 3
    elif qtype == Q.Q3_K:
        raw[:, :, 0:96] = 0  # hmask and low pairs 0: every value -4
        raw[:, :, 96:108] = np.where(np.arange(n) % 2 == 0, 0x00, 0xFF)[:, None, None]  # six-bit scales 0 / 63
    elif qtype == Q.IQ4_XS:
        raw[:, :, 2:8] = np.where(np.arange(n) % 2 == 0, 0x00, 0xFF)[:, None, None]  # six-bit scale 0 / 63
        raw[:, :, 8:] = 0  # every index 0: the level -127
    elif qtype in (Q.Q4_K, Q.Q5_K):
        raw[:, :, 4:16] = 0xFF  # six-bit scales and mins all 63
        raw[:, :, 16:] = 0xFF  # nibbles all 15 (and Q5_K's fifth bits all set)
    else:
        raw[:, :, 0:192] = 0xFF  # ql and qh: q = 63
        raw[:, :, 192:208] = np.where(np.arange(n) % 2 == 0, 0x80, 0x7F)[:, None, None]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", K_TILED, ids=lambda t: t.name)
def test_packed_k_quant_tiles_match_float64(qtype: Q) -> None:
    """The batch-1 and few-row (speculative verification) K-quant tile kernels, whose sums stay in
    integers scaled by the sub-block scales (Q6_K: unsigned quants minus 32 times the activation's
    per-16 sums), against float64 of the dequantized weights times the kernel's quantized
    activations: random blocks, and blocks at the int16 / int32 limits with activations of +-127."""
    n, k = 24, 256 * 3
    for raw_np in (random_blocks(qtype, n, k, seed=19), extreme_blocks(qtype, n, k)):
        raw = torch.from_numpy(raw_np)
        packed = kernels.gguf_repack8(raw, int(qtype), k)
        w = torch.from_numpy(gguf_dequantize(raw_np, qtype).astype(np.float64))
        bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
        gen = torch.Generator().manual_seed(3)
        for m in range(1, 9):
            x = torch.randn(m, k, generator=gen)
            x[0] = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)  # every quant +-127
            if m > 1:
                x[1] = 1.0
            out = torch.empty(m, n)
            kernels.gguf_linear_packed(out, x, packed, int(qtype), bias)
            want = quantized_activations(x).double() @ w.T + bias.double()
            scale = (x.double().abs() @ w.abs().T) + bias.abs().double() + 1e-3
            err = ((out.double() - want).abs() / scale).max().item()
            assert err < 1e-5, f"{qtype.name} m={m}: error {err:.2e}"


def test_iq_grid_header_is_what_gguf_py_gives() -> None:
    """csrc/iq_grids.h (the IQ3 types' grid tables the kernels read) is what tokenloom/model/iq_grids.py
    writes from gguf-py's copies today: regenerate it with `python -m tokenloom.model.iq_grids`."""
    from tokenloom.model import iq_grids

    assert iq_grids.HEADER.read_text() == iq_grids.header_text()
    assert iq_grids.grid_words(__import__("gguf").quants.IQ3_XXS)[:2] == [0x04040404, 0x04040414]  # ggml's first two


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_batch_invariant_rows_do_not_depend_on_the_row_count(qtype: Q) -> None:
    """Batch-invariant (VLLM_BATCH_INVARIANT; set_batch_invariant): the tile kernel gives row r the same floats
    at every row count and place in the four-row tiling (one row alone, 2..9 rows beside it), and so does the
    row kernel on the file's blocks. Without it Q8_0's one-row form sums even and odd groups apart."""
    n, k = 8 * 5, 1024
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=23))
    packed = kernels.gguf_repack8(raw, int(qtype), k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    before = kernels.batch_invariant()
    try:
        kernels.set_batch_invariant(True)
        for run, w in ((kernels.gguf_linear_packed, packed), (kernels.gguf_linear, raw)):
            alone = torch.empty(9, n)
            for r in range(9):
                run(alone[r : r + 1], x[r : r + 1].contiguous(), w, int(qtype), None)
            for m in range(2, 10):
                got = torch.full((m, n), float("nan"))
                run(got, x[:m].contiguous(), w, int(qtype), None)
                torch.testing.assert_close(got, alone[:m], rtol=0, atol=0, msg=f"{run.__name__}, {m} rows")
    finally:
        kernels.set_batch_invariant(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dense_linear_rows_do_not_depend_on_the_row_count(dtype: torch.dtype) -> None:
    """The fused decoder's dense kernel (float layers, and a float LM head when batch-invariant) sums a row in
    one order at every row count, the K tail (K % 8) included."""
    n, k = 13, 100
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7))
    alone = torch.empty(5, n)
    for r in range(5):
        kernels.dense_linear(alone[r : r + 1], x[r : r + 1].contiguous(), w, None)
    for m in range(2, 6):
        got = torch.empty(m, n)
        kernels.dense_linear(got, x[:m].contiguous(), w, None)
        torch.testing.assert_close(got, alone[:m], rtol=0, atol=0)
    torch.testing.assert_close(alone, x @ w.float().T, rtol=1e-5, atol=1e-5)


def test_gguf_linear_keeps_the_tile_kernel_at_every_row_count_when_batch_invariant() -> None:
    """GGUFLinear (the LM head's path outside the fused decoder) reads the kernels' batch-invariant switch: 100 rows
    at once, past the GEMM crossover, equal one at a time (without it the batched GEMM takes them, which sums
    otherwise: not bit-equal on AVX2, measured)."""
    from tokenloom.model.gguf_weights import GGUFLinear, GGUFWeight

    n, k = 8 * 9, 512
    weight = GGUFWeight(kernels.gguf_repack8(torch.from_numpy(random_blocks(Q.Q4_K, n, k, seed=29)), int(Q.Q4_K), k),
                        int(Q.Q4_K), (n, k), packed8=True)
    head = GGUFLinear([weight], None, kernels)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(8))
    before = kernels.batch_invariant()
    try:
        kernels.set_batch_invariant(True)
        assert torch.equal(head(x), torch.cat([head(x[i : i + 1]) for i in range(100)]))
    finally:
        kernels.set_batch_invariant(before)
