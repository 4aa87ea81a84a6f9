"""Rotary position embedding (rope) tables, with HF's rope_scaling variants (linear, llama3)."""

from __future__ import annotations

import math

import torch

from tokenloom.model.config import ModelConfig

# The rope table grows on demand up to max_position_embeddings; this is its first size.
_INITIAL_ROPE_POSITIONS = 4096


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
