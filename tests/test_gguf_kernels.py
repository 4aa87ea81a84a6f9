"""The GGUF kernels (tokenloom/model/csrc/gguf_kernels.cpp) against gguf's reference dequantization.

Random blocks of every type (random bytes, with the float16 scale fields set to sane values), odd
row counts, token counts that exercise every tail of the four-token tiling, both activation dtypes,
the SIMD and the plain C++ paths. The oracle for `gguf_linear` is gguf.quants.dequantize(W) times the
activations after the kernel's own int8 quantization, which is ggml's for the weight's type (its
vec_dot_type: block_q8_0 / block_q8_1 per 32 with an fp16 scale, block_q8_K per 256 with a float
scale), computed here in torch: they must agree to float summation error. A second, looser check
against the unquantized activations bounds what that quantization costs.
"""

from __future__ import annotations

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
}  # fmt: skip
TYPES = list(F16_FIELDS)

kernels = gguf_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="GGUF kernels unavailable (no compiler)")


def random_blocks(qtype: Q, n: int, k: int, seed: int, f16_scale: float = 0.02) -> np.ndarray:
    """[n, row_bytes] uint8 of random blocks whose float16 fields are small normal numbers (std f16_scale)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((n, k // block)) * f16_scale).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def q8_0_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's AVX2 quantize_row_q8_0: per 32, q = round-half-even(x * (127 / max|x|)), d = max|x| / 127
    stored as fp16. Returns (q [M, K] float, d [M, K / 32] as the dot product uses it: fp16-rounded)."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv)
    return q.reshape(x.shape), (amax / 127.0).half().float().squeeze(-1)


def q8_k_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's quantize_row_q8_K_ref: per 256, max = the first element of largest |x| (signed), iscale =
    -127 / max, q = min(127, nearest_int(iscale * x)), d = 1 / iscale. Returns (q [M, K] float, d
    [M, K / 256])."""
    xf = x.float().reshape(x.shape[0], -1, 256)
    first = xf.abs().argmax(dim=-1, keepdim=True)  # torch: the first index of the maximum
    mx = xf.gather(-1, first)
    iscale = torch.where(mx != 0, torch.full_like(mx, -127.0) / mx, torch.zeros_like(mx))
    q = torch.round(iscale * xf).clamp(max=127.0)
    d = torch.where(mx != 0, torch.ones_like(mx) / iscale, torch.zeros_like(mx))
    return q.reshape(x.shape), d.squeeze(-1)


def quantized_activations(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x as the kernels of qtype see it (ggml's rounding for the type), dequantized (fp32)."""
    kquant = qtype in K_QUANTS
    q, d = q8_k_reference(x) if kquant else q8_0_reference(x)
    group = 256 if kquant else 32
    return (q.reshape(x.shape[0], -1, group) * d[..., None]).reshape(x.shape)


def reference_product(x: torch.Tensor, raw: np.ndarray, qtype: Q, act_type: Q | None = None) -> torch.Tensor:
    """float64 [M, N]: the dequantized weight (raw blocks [N, row_bytes]) times x as the kernels of
    qtype (or act_type, when given) quantize it. Q4_1 / Q5_1 multiply block_q8_1, whose s = fp16(d *
    sum(q)) is rounded on its own: ggml's dot adds m_w * s, not m_w * fp16(d) * sum(q), as this does."""
    raw = np.asarray(raw)
    n = raw.shape[0]
    w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float64))
    out = quantized_activations(x, act_type or qtype).double() @ w.T
    if (act_type or qtype) in (Q.Q4_1, Q.Q5_1):
        size = GGML_QUANT_SIZES[qtype][1]
        m_w = raw.reshape(n, -1, size)[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        q, dh = q8_0_reference(x)
        sums = q.reshape(x.shape[0], -1, 32).sum(-1)
        d = x.float().abs().reshape(x.shape[0], -1, 32).amax(-1) / 127.0
        s_q8_1 = (d * sums).half().float()
        out += (s_q8_1 - dh * sums).double() @ torch.from_numpy(m_w).T
    return out


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
                    want = reference_product(x, raw, qtype) + bias.double()
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


@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_packed_layout_matches_rows(qtype: Q, scalar: bool) -> None:
    """The 8-row interleaved layout (gguf_repack8 + gguf_linear_packed) computes what the row kernel does."""
    kernels.set_force_scalar(scalar)
    try:
        n, k = (24, 512) if qtype in (Q.Q4_K, Q.Q6_K) else (24, 96)
        raw = torch.from_numpy(random_blocks(qtype, n, k, seed=3))
        packed = kernels.gguf_repack8(raw, int(qtype), k)
        # Same bytes, reordered; Q4_K's six-bit scales and mins unpacked to bytes (1184 per 1152).
        assert packed.numel() == (raw.numel() * 1184 // 1152 if qtype == Q.Q4_K else raw.numel())
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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_loader_dequantizes_every_kernel_type(qtype: Q) -> None:
    """Loading a GGUF dequantized (the default) handles the K-quants too, for every model family."""
    from tokenloom.model.gguf import GGUFTensor, dequantize

    n, k = shapes(qtype)[1]
    raw = random_blocks(qtype, n, k, seed=5)
    got = dequantize(GGUFTensor(name="w", qtype=qtype, shape=(n, k), raw=raw.reshape(-1)))
    torch.testing.assert_close(got, torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_embedding_rows_from_the_packed_layout(qtype: Q) -> None:
    """A tied embedding reads its rows from the LM head's 8-row copy: the same values as the file's rows."""
    n, k = (24, 512) if qtype in (Q.Q4_K, Q.Q6_K) else (24, 96)
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


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q4_K], ids=["q8_0-form", "q8_1-form", "q8_K-form"])
def test_activation_quantizer_simd_matches_plain(qtype: Q) -> None:
    """The AVX2 quantizer of the kernels' activations writes the same bytes, d, s and per-16 sums as
    the plain loop and as the torch oracle of ggml's rule for the weight type, ties rounded half to even."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 768, generator=gen) * torch.logspace(-3, 2, 5)[:, None]
    x[1, 256:512] = 0.0  # an all-zero group and super-block: d = 0, q = 0
    ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])
    x[2, 0:256] = ties.repeat(32)  # amax 127: x * 127 / amax (q8_K: x * -127 / -127) are exact halves
    x[2, 0] = -127.0  # the first largest |x| is negative: q8_K iscale = -127 / -127 = 1
    got = kernels.gguf_quantize_act(x, int(qtype))
    kernels.set_force_scalar(True)
    try:
        plain = kernels.gguf_quantize_act(x, int(qtype))
    finally:
        kernels.set_force_scalar(False)
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    q, d, s, bs = got
    assert q[2, 1:8].tolist() == [2, -4, 0, 0, 2, 126, -126]
    kquant = qtype in K_QUANTS
    want_q, want_d = q8_k_reference(x) if kquant else q8_0_reference(x)
    assert torch.equal(q.float(), want_q)
    # The kernels read d per group of 32: a K-quant super-block's d repeated over its eight groups.
    assert torch.equal(d, want_d.repeat_interleave(8, dim=1) if kquant else want_d)
    sums = q.float().reshape(5, -1, 32).sum(-1)
    if qtype == Q.Q4_1:  # block_q8_1's s: fp16(d * sum(q)) with d unrounded
        assert torch.equal(s, (x.abs().reshape(5, -1, 32).amax(-1) / 127.0 * sums).half().float())
    else:
        assert torch.equal(s, d * sums)
    assert torch.equal(bs, q.reshape(5, -1, 16).sum(-1, dtype=torch.int16))  # ggml's bsums (Q4_K mins, Q6_K offset)


def test_q8_k_block_is_ggmls() -> None:
    """One hand-computed block_q8_K (ggml's quantize_row_q8_K_ref): ONE scale for 256 values, taken
    from the first element of largest |x| with its sign (iscale = -127 / max, d = 1 / iscale), so
    small groups keep small quants where a per-32 scale would stretch each group to +-127."""
    x = torch.zeros(1, 256)
    x[0, :4] = torch.tensor([-127.0, 127.0, 2.5, 3.5])  # max = -127 (first): iscale = 1, d = 1
    x[0, 32:64] = 1.0  # a group of ones: q = 1 (per 32 it would be 127)
    x[0, 64:96] = 0.5  # exact halves: nearest_int rounds half to even, 0
    q, d, s, bs = kernels.gguf_quantize_act(x, int(Q.Q4_K))
    assert q[0, :4].tolist() == [-127, 127, 2, 4]
    assert q[0, 32:64].tolist() == [1] * 32 and q[0, 64:96].tolist() == [0] * 32
    assert d[0].tolist() == [1.0] * 8  # one scale, repeated per group of 32
    assert s[0, :3].tolist() == [6.0, 32.0, 0.0]
    assert bs[0, :4].tolist() == [6, 0, 16, 16]
    y = torch.zeros(1, 256)
    y[0, 5] = 3.0  # positive max: iscale = -127 / 3, d = 1 / iscale (negative)
    y[0, 9] = -1.0
    q, d, _, _ = kernels.gguf_quantize_act(y, int(Q.Q6_K))
    iscale = torch.tensor(-127.0) / torch.tensor(3.0)
    assert q[0, 5].item() == -127 and q[0, 9].item() == 42  # nearest_int(42.333)
    assert d[0, 0].item() == (torch.tensor(1.0) / iscale).item() < 0


def test_q8_0_scale_is_fp16_rounded() -> None:
    """block_q8_0 stores d = max|x| / 127 as fp16 and ggml's dot multiplies by that: the kernels'
    d is the fp16 value (1 / 127 is not one), and a Q8_0 linear's output uses it."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 1:] = 0.5
    q, d, s, _ = kernels.gguf_quantize_act(x, int(Q.Q8_0))
    dh = torch.tensor(1.0 / 127.0).half().float().item()
    assert dh != torch.tensor(1.0 / 127.0).item()
    assert d[0, 0].item() == dh and q[0, :2].tolist() == [127, 64]  # 63.5 rounds to even
    assert s[0, 0].item() == dh * (127 + 31 * 64)
    # A Q8_0 weight of ones with d = 1: out = dh * sum(q), exactly (integers and one fp16 factor).
    w = np.zeros((8, 34), dtype=np.uint8)
    w[:, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    w[:, 2:] = 1
    out = torch.empty(1, 8)
    kernels.gguf_linear(out, x, torch.from_numpy(w), int(Q.Q8_0), None)
    assert out[0].tolist() == [torch.tensor(dh * (127 + 31 * 64)).item()] * 8


PACKED_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K]


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
        kquant = qtype in (Q.Q4_K, Q.Q6_K)
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
            want = reference_product(x, raw, qtype) + bias.double()
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
        want = reference_product(x, raw, qtype)
        scale = (x.abs() @ w.abs().T).double() + 1e-3
        assert ((wide[:, 8 : 8 + n].double() - want).abs() / scale).max().item() < 1e-5
        assert bool((wide[:, :8] == 7.0).all()) and bool((wide[:, 8 + n :] == 7.0).all())
    finally:
        kernels.set_force_scalar(False)


def extreme_blocks(qtype: Q, n: int, k: int) -> np.ndarray:
    """Blocks at the integer sums' limits: every quant at its maximum (Q4_K 15, Q6_K 63) and the
    sub-block scales at theirs (Q4_K 63, Q6_K -128 in even rows and 127 in odd ones)."""
    raw = random_blocks(qtype, n, k, seed=17).reshape(n, k // 256, -1)
    if qtype == Q.Q4_K:
        raw[:, :, 4:16] = 0xFF  # six-bit scales and mins all 63
        raw[:, :, 16:144] = 0xFF  # nibbles all 15
    else:
        raw[:, :, 0:192] = 0xFF  # ql and qh: q = 63
        raw[:, :, 192:208] = np.where(np.arange(n) % 2 == 0, 0x80, 0x7F)[:, None, None]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_packed_k_quant_tiles_match_float64(qtype: Q) -> None:
    """The batch-1 and few-row (speculative verification) Q4_K / Q6_K tile kernels, whose sums stay in
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
            want = quantized_activations(x, qtype).double() @ w.T + bias.double()
            scale = (x.double().abs() @ w.abs().T) + bias.abs().double() + 1e-3
            err = ((out.double() - want).abs() / scale).max().item()
            assert err < 1e-5, f"{qtype.name} m={m}: error {err:.2e}"


def fused_step_reference(parts: dict, norms: dict, embed: torch.Tensor, ids: list[int],
                         act_type: Q | None = None) -> torch.Tensor:
    """One decode step at position 0 (attention returns each query head's kv head's V) of a one-layer
    model whose linears are lists of (raw blocks, type), each part multiplying x rounded for its own
    type (act_type: every part rounded for that type instead, the wrong form)."""

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.cat([reference_product(x, raw, t, act_type).float() for raw, t in parts[name]], -1)

    def norm(v: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.rms_norm(v, (v.shape[-1],), norms[name], 1e-6)

    h = embed[torch.tensor(ids)]
    v = lin(norm(h, "attn"), "qkv")[:, 384:512]  # q 4 x 64, k 2 x 64, then v 2 x 64
    att = torch.cat([v[:, 0:64], v[:, 0:64], v[:, 64:128], v[:, 64:128]], -1)  # 4 query heads on 2 kv heads
    h = h + lin(att, "o")
    g, u = lin(norm(h, "ffn"), "gate_up").split(512, -1)
    h = h + lin(torch.nn.functional.silu(g) * u, "down")
    return norm(h, "final")


def test_fused_step_rounds_each_part_for_its_type() -> None:
    """The fused decode step feeds K-quant and Q8_0-family parts from one input, as the 0.5B's mix
    (Q5_0 / Q8_0 / Q4_K / Q6_K) does: every part must multiply the activations rounded for its own
    type (q8_K per 256 for Q4_K / Q6_K, fp16-scaled per 32 for Q8_0 / Q5_0, q8_1 for Q4_1), each
    input quantized once per form, two rows sharing the per-256 units between threads."""
    gen = torch.Generator().manual_seed(0)
    small = {Q.Q4_K: 0.0005, Q.Q6_K: 0.0005, Q.Q8_0: 0.002, Q.Q5_0: 0.005, Q.Q4_1: 0.005}

    def blocks(t: Q, n: int, k: int, seed: int) -> np.ndarray:
        return random_blocks(t, n, k, seed=seed, f16_scale=small[t])

    parts = {
        "qkv": [(blocks(Q.Q4_K, 256, 256, 1), Q.Q4_K), (blocks(Q.Q8_0, 128, 256, 2), Q.Q8_0),
                (blocks(Q.Q6_K, 128, 256, 3), Q.Q6_K)],
        "o": [(blocks(Q.Q6_K, 128, 256, 4), Q.Q6_K), (blocks(Q.Q5_0, 128, 256, 5), Q.Q5_0)],
        "gate_up": [(blocks(Q.Q4_K, 512, 256, 6), Q.Q4_K), (blocks(Q.Q4_1, 512, 256, 7), Q.Q4_1)],
        "down": [(blocks(Q.Q6_K, 256, 512, 8), Q.Q6_K)],
    }  # fmt: skip
    norms = {n: 1 + 0.1 * torch.randn(256, generator=gen) for n in ("attn", "ffn", "final")}
    embed = torch.randn(10, 256, generator=gen)
    dec = kernels.FusedDecoder(256, 4, 2, 64, 512, 1e-6, embed, 0, norms["final"], False)

    def spec(name: str) -> list:
        return [(torch.from_numpy(raw), int(t), None, False) for raw, t in parts[name]]

    dec.add_layer(norms["attn"], spec("qkv"), spec("o"), norms["ffn"], spec("gate_up"), spec("down"))
    kv = torch.zeros(1, 2, 2, 4, 4, 64)  # [layers, k / v, kv heads, blocks, block size, head dim]
    dec.set_kv_caches([kv[0, 0]], [kv[0, 1]])
    ids = [3, 7]
    out = torch.empty(2, 256)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    dec.step(out, torch.tensor(ids), torch.tensor([0, 0]), torch.tensor([0, 8]), table, torch.ones(1, 32),
             torch.zeros(1, 32))
    want = fused_step_reference(parts, norms, embed, ids)
    err = ((out - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    # Every part rounded per 32 instead (the kernels' rounding before ggml's forms): far further off.
    wrong = fused_step_reference(parts, norms, embed, ids, act_type=Q.Q8_0)
    err_wrong = ((out - wrong).norm(dim=-1) / wrong.norm(dim=-1)).max().item()
    # Measured 1e-7 (float summation order) against 2e-2 for the per-32 rounding.
    assert err < 1e-5 and err_wrong > 1e-3, (err, err_wrong)
