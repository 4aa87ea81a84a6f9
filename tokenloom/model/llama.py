"""Llama / Qwen2 decoder over one flattened batch of exactly the scheduled tokens (no padding).

Weights come in with Hugging Face names and are rearranged once at load for speed: q/k/v fused
into one matrix (one GEMM instead of three), gate/up fused likewise, everything cast to the run
dtype and moved to the device. bf16 GEMMs on CPU go to oneDNN through plain F.linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.model.attention import AttentionMetadata, KVCache, paged_attention
from tokenloom.model.config import ModelConfig

# The rope table grows on demand up to max_position_embeddings; this is its first size.
_INITIAL_ROPE_POSITIONS = 4096


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


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

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, D / 2]: computed once per step, shared by all layers."""
        if max_position >= self.cos.shape[0]:
            self._build(max(max_position + 1, 2 * self.cos.shape[0]))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

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
    ) -> None:
        self.config = config
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
            self.lm_head = get("lm_head.weight")
        else:
            self.lm_head = self.embed_tokens
        self.layers = [self._load_layer(get, i) for i in range(config.num_hidden_layers)]
        self.rope = RotaryEmbedding(config, self.device, dtype)

    @staticmethod
    def _load_layer(get: _WeightReader, i: int) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return _Layer(
            input_norm=get(p + "input_layernorm.weight"),
            qkv_weight=get.cat([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]),
            qkv_bias=get.cat_optional([attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]),
            o_weight=get(attn + "o_proj.weight"),
            o_bias=get.optional(attn + "o_proj.bias"),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up_weight=get.cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
            gate_up_bias=get.cat_optional([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
            down_weight=get(mlp + "down_proj.weight"),
            down_bias=get.optional(mlp + "down_proj.bias"),
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
        cos, sin = self.rope.tables(positions, max_position)
        h = F.embedding(input_ids, self.embed_tokens)  # a fresh tensor: the residual adds go in place
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_norm, self.eps)
            h += self._attention(layer, x, cos, sin, attn_metadata, kv_cache)
            h += self._mlp(layer, rms_norm(h, layer.post_norm, self.eps))
        return rms_norm(h, self.final_norm, self.eps)

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
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
        # Rotate q and k together: one set of elementwise kernels for both.
        qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        o = paged_attention(qk[:, :hq], qk[:, hq:], v, kv_cache, meta)
        return F.linear(o, layer.o_weight, layer.o_bias)

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states of the sampling rows [S, H] -> fp32 logits [S, V]."""
        return F.linear(hidden, self.lm_head).float()


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
