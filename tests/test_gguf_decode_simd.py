"""The decode step's non-GEMV kernels (RMSNorm, attention over the paged cache, the softmax's and
SiLU's vectorized exp) against a plain torch forward, on a small random model with float32 (dense)
weights so that no activation quantization blurs the comparison. head_dim 64 and 128 take the
register-resident attention (attend_simd<8> / <16>), 40 takes the generic loop; 20 positions cover
the 8-wide exp and its tail; an intermediate size of 300 leaves SiLU a tail of 12. The same steps
with the plain C++ paths forced must agree too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model.gguf_kernels import gguf_kernels

kernels = gguf_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="GGUF kernels unavailable (no compiler)")
H, HQ, HKV, INTER, LAYERS, VOCAB, EPS, STEPS = 256, 4, 2, 300, 2, 50, 1e-5, 20


def random_model(d: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g) / k**0.5

    m = {"embed": torch.randn(VOCAB, H, generator=g), "norm": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(LAYERS):
        m[f"{i}.attn_norm"] = 1 + 0.1 * torch.randn(H, generator=g)
        m[f"{i}.ffn_norm"] = 1 + 0.1 * torch.randn(H, generator=g)
        m[f"{i}.qkv"] = w((HQ + 2 * HKV) * d, H) * 3  # sharper attention than a 1/sqrt(K) init gives
        m[f"{i}.o"] = w(H, HQ * d)
        m[f"{i}.gate_up"] = w(2 * INTER, H) * 2
        m[f"{i}.down"] = w(H, INTER)
    return m


def reference(m: dict[str, torch.Tensor], d: int, ids: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t = len(ids)
    c, s = cos[:t, None], sin[:t, None]

    def rot(v: torch.Tensor) -> torch.Tensor:
        a, b = v[..., : d // 2], v[..., d // 2 :]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    x = m["embed"][torch.tensor(ids)]
    for i in range(LAYERS):
        h = F.rms_norm(x, (H,), m[f"{i}.attn_norm"], EPS)
        q, k, v = (h @ m[f"{i}.qkv"].T).split([HQ * d, HKV * d, HKV * d], -1)
        q = rot(q.view(t, HQ, d)).transpose(0, 1)[None]
        k = rot(k.view(t, HKV, d)).transpose(0, 1)[None]
        v = v.view(t, HKV, d).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        x = x + o.reshape(t, -1) @ m[f"{i}.o"].T
        g, u = (F.rms_norm(x, (H,), m[f"{i}.ffn_norm"], EPS) @ m[f"{i}.gate_up"].T).split(INTER, -1)
        x = x + (F.silu(g) * u) @ m[f"{i}.down"].T
    return F.rms_norm(x, (H,), m["norm"], EPS)


def decode(m: dict[str, torch.Tensor], d: int, ids: list[int], cos: torch.Tensor, sin: torch.Tensor,
           kv_dtype: torch.dtype) -> torch.Tensor:
    def part(w: torch.Tensor) -> list:
        return [(w.contiguous(), 0, None, False)]

    dec = kernels.FusedDecoder(H, HQ, HKV, d, INTER, EPS, m["embed"], 0, m["norm"], False)
    for i in range(LAYERS):
        dec.add_layer(m[f"{i}.attn_norm"], part(m[f"{i}.qkv"]), part(m[f"{i}.o"]), m[f"{i}.ffn_norm"],
                      part(m[f"{i}.gate_up"]), part(m[f"{i}.down"]))
    bs = 4
    kv = torch.zeros(LAYERS, 2, HKV, 8, bs, d, dtype=kv_dtype)
    dec.set_kv_caches([kv[i, 0] for i in range(LAYERS)], [kv[i, 1] for i in range(LAYERS)])
    table = torch.tensor([[6, 1, 7, 3, 0, 5]], dtype=torch.int32)  # out of order: the table is followed
    rows = []
    for pos, tok in enumerate(ids):
        out = torch.empty(1, H)
        slot = int(table[0, pos // bs]) * bs + pos % bs
        dec.step(out, torch.tensor([tok]), torch.tensor([pos]), torch.tensor([slot]), table, cos, sin)
        rows.append(out)
    return torch.cat(rows)


@pytest.mark.parametrize("d", [64, 128, 40])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_step_matches_torch(d: int, kv_dtype: torch.dtype) -> None:
    m = random_model(d, seed=d)
    ids = torch.randint(0, VOCAB, (STEPS,), generator=torch.Generator().manual_seed(1)).tolist()
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    want = reference(m, d, ids, cos, sin) if kv_dtype == torch.float32 else None
    got = decode(m, d, ids, cos, sin, kv_dtype)
    kernels.set_force_scalar(True)
    try:
        plain = decode(m, d, ids, cos, sin, kv_dtype)
    finally:
        kernels.set_force_scalar(False)
    # bf16 caches: the SIMD and plain dense kernels sum in different orders, so a K or V value on a
    # rounding boundary can land one bf16 step apart (~0.4 %): bounded, far below a broken kernel's error.
    if kv_dtype == torch.float32:
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
    else:
        rel = ((got - plain).norm(dim=-1) / plain.norm(dim=-1)).max().item()
        assert rel < 2e-3, rel
    if want is not None:  # bf16 caches round K and V: only SIMD vs plain is exact enough to hold
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.abs().max() > 0.5  # a real signal, not zeros agreeing with zeros
