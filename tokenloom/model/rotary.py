"""Rotary position embedding (rope) tables, with HF's rope_scaling variants (linear, llama3, longrope)."""

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
    if rope_type in ("longrope", "su"):
        return _longrope_inv_freq(config, scaling, long=False)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


def _longrope_original_max(config: ModelConfig, scaling: dict) -> int:
    original = scaling.get("original_max_position_embeddings") or config.extra.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling type 'longrope' needs original_max_position_embeddings in config.json")
    return int(original)


def _longrope_inv_freq(config: ModelConfig, scaling: dict, long: bool) -> torch.Tensor:
    """Phi-3's LongRoPE ("su"): per-frequency divisors, short_factor within the original context,
    long_factor beyond it (transformers' _compute_longrope_parameters)."""
    for key in ("short_factor", "long_factor"):
        if key not in scaling:
            raise ValueError(f"rope_scaling type 'longrope' needs {key!r} in config.json")
    dim = config.head_dim
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise ValueError(f"rope_scaling {'long' if long else 'short'}_factor has {ext.numel()} entries, "
                         f"head_dim / 2 = {dim // 2}")
    return 1.0 / (ext * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos/sin are scaled by (LongRoPE's attention factor; 1 otherwise)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = _longrope_original_max(config, scaling)
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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
        self.attention_factor = rope_attention_factor(config)
        scaling = config.rope_scaling or {}
        self.long_inv_freq, self.long_from = None, 0
        if scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            self.long_inv_freq = _longrope_inv_freq(config, scaling, long=True)
            self.long_from = _longrope_original_max(config, scaling)
        self.max_positions = config.max_position_embeddings
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0)
        self._build(min(self.max_positions, _INITIAL_ROPE_POSITIONS))

    def _build(self, num_positions: int) -> None:
        # fp32 angles, cast once to the run dtype: what HF does per forward.
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        if self.long_inv_freq is not None and num_positions > self.long_from:
            # LongRoPE: positions past the original context use the long factors. (HF switches the
            # whole forward to them once the sequence passes that length; per position is vLLM's
            # choice too, and keeps cached keys valid.)
            long_pos = torch.arange(self.long_from, num_positions, dtype=torch.float32)
            freqs[self.long_from :] = torch.outer(long_pos, self.long_inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos = cos.to(self.device, self.dtype)
        self.sin = sin.to(self.device, self.dtype)

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
