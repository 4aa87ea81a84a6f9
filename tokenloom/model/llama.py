"""Llama / Qwen2 decoder over one flattened batch of exactly the scheduled tokens (no padding).

Weights come in with Hugging Face names and are rearranged once at load for speed: q/k/v fused
into one matrix (one GEMM instead of three), gate/up fused likewise, everything cast to the run
dtype and moved to the device. bf16 GEMMs on CPU go to oneDNN through plain F.linear.

With the compiled CPU kernels (`kernels`, see tokenloom/model/kernels.py) a layer is four GEMMs
plus five fused calls: rotary + KV-cache write, paged attention over the whole step, residual add +
RMSNorm (twice) and SiLU-and-mul. Without them (CUDA, or no compiler) the same arithmetic runs as
plain torch ops.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.model.attention import AttentionMetadata, KVCache, paged_attention, paged_attention_fused
from tokenloom.model.config import ModelConfig
from tokenloom.model.gemm_rows import packed_rows

logger = logging.getLogger(__name__)

# The rope table grows on demand up to max_position_embeddings; this is its first size.
_INITIAL_ROPE_POSITIONS = 4096


@dataclass
class Linear:
    """y = x @ weight.T + bias. `packed`: the weight reordered once into oneDNN's blocked layout
    (CPU bf16, see `pack_linear`), which skips the per-call reorder: 5-30 % faster GEMMs here."""

    weight: torch.Tensor | None  # [out, in]; dropped once packed (the packed copy replaces it)
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0]
        rows = packed_rows(m)
        if rows == m:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        padded = x.new_zeros((rows, x.shape[1]))
        padded[:m].copy_(x)
        return torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:m]


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [(Hq + 2 Hkv) * D, H]
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 I, H]
    down: Linear


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN weight pre-packing: CPU bf16 only (fp32 GEMMs go to MKL, which packs nothing faster),
    and off with TOKENLOOM_PACKED_LINEAR=0."""
    if os.environ.get("TOKENLOOM_PACKED_LINEAR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def pack_linear(lin: Linear, batch_hint: int = 128, check: bool = False) -> bool:
    """Pre-pack `lin` in place (a private torch API: any failure, or with `check` a result that
    differs from F.linear, leaves it unpacked). True if packed."""
    assert lin.weight is not None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight, batch_hint)
        if check:
            probe = torch.randn(3, lin.weight.shape[1], generator=torch.Generator().manual_seed(0))
            probe = probe.to(lin.weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, lin.bias, "none", [], "").float()
            want = F.linear(probe, lin.weight, lin.bias).float()
            tol = 1e-2 * want.abs().max().item()
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2, atol=tol):
                return False
    except (RuntimeError, AttributeError, TypeError):
        return False
    lin.packed = packed
    return True


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, [head_dim / 2]) as HF computes them, with rope_scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (same formula as transformers' rope utils)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style (rotate_half) rotary embedding from precomputed cos/sin tables."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.max_positions = config.max_position_embeddings
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0)
        self._build(min(self.max_positions, _INITIAL_ROPE_POSITIONS))

    def _build(self, num_positions: int) -> None:
        # fp32 angles, cast once to the run dtype: what HF does per forward.
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        self.cos = freqs.cos().to(self.device, self.dtype)
        self.sin = freqs.sin().to(self.device, self.dtype)

    def full_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [P, D / 2] (P > max_position), grown if needed."""
        if max_position >= self.cos.shape[0]:
            self._build(max(max_position + 1, 2 * self.cos.shape[0]))
        return self.cos, self.sin

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, D / 2]: computed once per step, shared by all layers."""
        cos, sin = self.full_tables(max_position)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> rotated copy. Same arithmetic as HF's q*cos + rotate_half(q)*sin."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm. torch's kernel accumulates in fp32 and rounds once, so in bf16 it is slightly more
    accurate than HF's (which rounds the normalized x before scaling), and faster."""
    return F.rms_norm(x, weight.shape, weight, eps)


class LlamaModel:
    """The network. `forward` maps the step's tokens to final hidden states; `compute_logits`
    projects only the rows that sample."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernels: Any = None,
    ) -> None:
        """`kernels`: the compiled CPU kernels module (tokenloom.model.kernels.cpu_kernels()), or None."""
        self.config = config
        self.kernels = kernels if torch.device(device).type == "cpu" else None
        # The KV cache holds the kernels' packed bf16 layout (set by the runner, which allocates it).
        self.kv_packed = False
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        get = _WeightReader(weights, self.device, dtype)
        self.embed_tokens = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = Linear(get("lm_head.weight"))
        else:
            self.lm_head = Linear(self.embed_tokens)
        self.layers = [self._load_layer(get, i) for i in range(config.num_hidden_layers)]
        self.rope = RotaryEmbedding(config, self.device, dtype)
        self.packed_linear = packing_enabled(self.device, dtype) and self._pack_all()

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [
            self.lm_head
        ]

    def _pack_all(self) -> bool:
        """Pre-pack every linear weight, or none (a partial failure leaves all on F.linear)."""
        lins = self.linears()
        # The first one is checked against F.linear: the API is private, a torch upgrade could change it.
        if all(pack_linear(lin, check=i == 0) for i, lin in enumerate(lins)):
            for lin in lins:
                lin.weight = None  # the packed copy replaces it (the tied lm_head's lives on as embed_tokens)
            return True
        for lin in lins:
            lin.packed = None
        logger.warning("oneDNN weight pre-packing is unavailable here; using F.linear")
        return False

    @staticmethod
    def _load_layer(get: _WeightReader, i: int) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return _Layer(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=Linear(
                get.cat([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]),
                get.cat_optional([attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]),
            ),
            o=Linear(get(attn + "o_proj.weight"), get.optional(attn + "o_proj.bias")),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=Linear(
                get.cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
                get.cat_optional([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
            ),
            down=Linear(get(mlp + "down_proj.weight"), get.optional(mlp + "down_proj.bias")),
        )

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.shape[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
        max_position: int | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-norm hidden states [T, H]. Writes this step's K/V."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        if self.kernels is not None and attn_metadata.kernel is not None:
            return self._forward_fused(input_ids, positions, attn_metadata, kv_caches, max_position)
        cos, sin = self.rope.tables(positions, max_position)
        h = F.embedding(input_ids, self.embed_tokens)  # a fresh tensor: the residual adds go in place
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_norm, self.eps)
            h += self._attention(layer, x, cos, sin, attn_metadata, kv_cache)
            h += self._mlp(layer, rms_norm(h, layer.post_norm, self.eps))
        return rms_norm(h, self.final_norm, self.eps)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        max_position: int,
    ) -> torch.Tensor:
        """The same network through the compiled CPU kernels (see the module docstring)."""
        k = self.kernels
        assert meta.kernel is not None
        cos, sin = self.rope.full_tables(max_position)
        hq, eps = self.num_q_heads, self.eps
        h = F.embedding(input_ids, self.embed_tokens)  # the residual stream, updated in place
        x = torch.empty_like(h)
        k.rms_norm(x, h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = layer.qkv(x)
            k.rotary_and_cache(qkv, positions, cos, sin, hq, kv_cache[0], kv_cache[1], meta.slot_mapping,
                               self.kv_packed)
            attn_meta = meta.kernel
            if i == last and meta.output_rows is not None:
                # Every row's K/V is written; only the output rows go on (see AttentionMetadata).
                assert meta.output_kernel is not None
                if meta.output_rows.numel() == 0:
                    return h[:0]
                qkv, h = qkv.index_select(0, meta.output_rows), h.index_select(0, meta.output_rows)
                attn_meta = meta.output_kernel
            o = paged_attention_fused(k, qkv, hq, kv_cache, attn_meta, self.kv_packed)
            x = layer.o(o)
            k.fused_add_rms_norm(x, h, layer.post_norm, eps)  # h += attention; x = norm(h)
            gate_up = layer.gate_up(x)
            act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            k.silu_and_mul(act, gate_up)
            x = layer.down(act)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            k.fused_add_rms_norm(x, h, next_norm, eps)  # h += mlp; x = next layer's input (or final) norm
        return x

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)
        # Rotate q and k together: one set of elementwise kernels for both.
        qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        o = paged_attention(qk[:, :hq], qk[:, hq:], v, kv_cache, meta)
        return layer.o(o)

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Hidden states of the sampling rows [S, H] -> logits [S, V] (fp32, or the run dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits


class _WeightReader:
    """Fetches HF-named weights, cast to the run dtype and moved to the device."""

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        self.weights, self.device, self.dtype = weights, device, dtype

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return self._convert(self.weights[name])

    def optional(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.weights else None

    def cat(self, names: list[str]) -> torch.Tensor:
        return self._convert(torch.cat([self._raw(n) for n in names], dim=0))

    def cat_optional(self, names: list[str]) -> torch.Tensor | None:
        present = [n in self.weights for n in names]
        if not any(present):
            return None
        if not all(present):
            # e.g. only some of q/k/v carry a bias: the others get zeros so the fused GEMM stays one.
            ref = next(self.weights[n] for n, p in zip(names, present) if p)
            parts = [
                self._raw(n) if p else self._zero_bias_like(n, ref) for n, p in zip(names, present)
            ]
            return self._convert(torch.cat(parts))
        return self._convert(torch.cat([self._raw(n) for n in names]))

    def _zero_bias_like(self, bias_name: str, ref: torch.Tensor) -> torch.Tensor:
        out_features = self._raw(bias_name.removesuffix(".bias") + ".weight").shape[0]
        return torch.zeros(out_features, dtype=ref.dtype)

    def _raw(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return self.weights[name]

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=self.device, dtype=self.dtype).contiguous()
