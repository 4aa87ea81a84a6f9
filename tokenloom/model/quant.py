"""int8 W8A8 linear layers: `--quantization int8`.

Weights are quantized once at load, symmetric per output channel; activations per row (token) at
run time, symmetric too: scale = max|v| / 127, q = round-half-even(v * 127 / max|v|). The GEMM is
`torch._int_mm` (oneDNN; AVX512-VNNI runs int8 dot products at twice the bf16 rate), and the int32
result is scaled back by row scale × channel scale. The LM head stays in the run dtype: it decides
the sampled token, and in a decode step it is only the sampling rows' GEMM.

Per-row activation scales are at the mercy of outlier channels (a few input channels of a layer
run 10-100x larger than the rest, so every other channel gets few levels). SmoothQuant's remedy,
applied at load when calibration tokens are given: divide each input channel j by
s_j = max|X_j|^alpha / max|W_j|^(1-alpha) and multiply the weight's column j by it, which leaves the
product unchanged. The division is folded into what produces X (the RMSNorm weight for qkv and
gate/up, the `up` rows for down, the `v` rows for o), so it costs nothing at run time. Measured on
SmolLM2-135M (docs/performance.md, mean of three texts vs bf16): perplexity +3.0 % with plain W8A8,
+1.4 % smoothed.

The functions here are the reference arithmetic (and the path without the compiled kernels); the
kernels in csrc/cpu_kernels.cpp fuse the same steps into the neighbouring norm / activation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenloom.config import QUANTIZATION_METHODS

SMOOTHING_ALPHA = 0.6  # of 0.5 / 0.6 / 0.7 the best on the quality benchmark (docs/performance.md)
CALIBRATION_TEXT = Path(__file__).parent.parent / "data" / "calibration.txt"


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """Raise ValueError for a method tokenloom does not have, or one this device cannot run."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                         f"got {quantization!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only (oneDNN int8 GEMMs); got device {device}")


def calibration_token_ids(tokenizer: Any, max_positions: int) -> list[int]:
    """tokenloom/data/calibration.txt as the model's tokens, capped by its positions (not by
    max_model_len: a scheduling knob must not change the smoothing factors, and so the outputs)."""
    return tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))[:max_positions]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 [T, K], fp32 scales [T]): symmetric per row."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # A true division (`127.0 / amax` would be computed as 127 * (1 / amax)): bit-equal to the kernels.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [K, N] contiguous, the GEMM's B operand; fp32 scales [N])."""
    q, scale = quantize_rows(weight)
    return q.t().contiguous(), scale


def dequant(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [T, N] -> fp32: acc * row_scale[t] * col_scale[n] (+ bias[n])."""
    out = acc.float() * row_scale[:, None] * col_scale[None, :]
    return out + bias if bias is not None else out


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant factors per input channel, fp32 [K]: s = max|X|^alpha / max|W|^(1 - alpha), the
    weights' max taken over every matrix that reads X (e.g. q, k and v)."""
    wmax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


@dataclass
class Int8Linear:
    """y = x @ W.T + b with W int8 per output channel and x quantized per row on the fly."""

    qweight: torch.Tensor  # int8 [in, out]
    scale: torch.Tensor  # fp32 [out]
    bias: torch.Tensor | None  # fp32 [out]
    out_dtype: torch.dtype

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> Int8Linear:
        qweight, scale = quantize_weight(weight)
        return cls(qweight, scale, None if bias is None else bias.float().contiguous(), out_dtype)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def int_mm(self, q: torch.Tensor) -> torch.Tensor:
        """The int32 GEMM of already quantized rows [T, K] -> [T, N]."""
        return torch._int_mm(q, self.qweight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quantize_rows(x)
        return dequant(self.int_mm(q), s, self.scale, self.bias).to(self.out_dtype)
