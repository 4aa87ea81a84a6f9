"""int8 W8A8 linear layers: `--quantization int8`.

Weights are quantized once at load, symmetric per output channel; activations per row (token) at
run time, symmetric too: scale = max|v| / 127, q = round-half-even(v * 127 / max|v|). The GEMM is
`torch._int_mm` (oneDNN; AVX512-VNNI runs int8 dot products at twice the bf16 rate), and the int32
result is scaled back by row scale × channel scale. Where oneDNN's int8 GEMM saturates (see
`int_mm_exact`), the weight is kept as two exact 7-bit and 1-bit halves instead. The LM head stays
in the run dtype: it decides the sampled token, and in a decode step it is only the sampling rows'
GEMM.

Per-row activation scales are at the mercy of outlier channels (a few input channels of a layer
run 10-100x larger than the rest, so every other channel gets few levels). SmoothQuant's remedy,
applied at load when calibration tokens are given: divide each input channel j by
s_j = max|X_j|^alpha / max|W_j|^(1-alpha) and multiply the weight's column j by it, which leaves the
product unchanged. The division is folded into what produces X (the RMSNorm weight for qkv and
gate/up, the `up` rows for down, the `v` rows for o), so it costs nothing at run time. Measured on
SmolLM2-135M (docs/performance.md, mean of three texts vs bf16): perplexity +3.0 % with plain W8A8,
+1.4 % smoothed.

The functions here are the reference arithmetic (and the path without the compiled kernels); the
kernels in csrc/cpu_kernels.cpp fuse the same steps into the neighbouring norm / activation, which
`Int8LinearMethod` chooses (the linear-method seam: tokenloom/model/linear.py). Calibration and
the smoothing folds live in tokenloom/model/smoothquant.py.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tokenloom.config import QUANTIZATION_METHODS
from tokenloom.model.linear import LinearBase, LinearMethodBase, PendingOutput, UnquantizedLinearMethod

CALIBRATION_TEXT = Path(__file__).parent.parent / "data" / "calibration.txt"
logger = logging.getLogger(__name__)


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """Raise ValueError for a method tokenloom does not have, or one this device cannot run."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                         f"got {quantization!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only; got device {device}")


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


@functools.cache
def int_mm_exact() -> bool:
    """Whether `torch._int_mm` computes exact int8 products on this CPU. oneDNN's JIT GEMM for CPUs
    without VNNI (AVX-512 without VNNI; AVX2 under ONEDNN_MAX_CPU_ISA) shifts the activations to
    unsigned bytes and multiplies them with vpmaddubsw, whose int16 pair sums saturate at 32767:
    127 x 127 activations and weights came back as garbage (its docs ask for 7-bit weights there).
    Asked once per process with the worst case, so any oneDNN build and CPU is covered."""
    a = torch.full((17, 64), 127, dtype=torch.int8)
    b = torch.full((64, 16), 127, dtype=torch.int8)
    exact = bool((torch._int_mm(a, b) == 64 * 127 * 127).all())
    if not exact:
        logger.warning("this CPU's int8 GEMM (oneDNN without VNNI) saturates full-range int8 weights: "
                       "int8 layers keep each weight as exact 7-bit and 1-bit halves (two GEMMs)")
    return exact


def split_weight(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 W -> (hi, lo) with W = 2 * hi + lo, hi = floor(W / 2) in [-64, 63] and lo in {0, 1}: each
    a weight oneDNN's saturating GEMM multiplies exactly (255 x 63 x 2 < 32768)."""
    hi = torch.div(qweight, 2, rounding_mode="floor").to(torch.int8)
    return hi, (qweight - 2 * hi).to(torch.int8)


def dequant(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [T, N] -> fp32: acc * row_scale[t] * col_scale[n] (+ bias[n])."""
    out = acc.float() * row_scale[:, None] * col_scale[None, :]
    return out + bias if bias is not None else out


@dataclass
class Int8Rows:
    """An int8 method's input: int8 rows [T, K] and their fp32 scales [T]."""

    q: torch.Tensor
    scale: torch.Tensor


def _quant_buffers(rows: int, cols: int) -> Int8Rows:
    """Uninitialised int8 rows and their fp32 scales, for a kernel to fill."""
    return Int8Rows(torch.empty((rows, cols), dtype=torch.int8), torch.empty(rows, dtype=torch.float32))


@dataclass
class Int8Accumulator(PendingOutput):
    """An int8 GEMM's int32 result [T, N] with its input's row scales: not yet scaled back, so the
    next fused kernel can do it in its own pass."""

    acc: torch.Tensor
    row_scale: torch.Tensor
    layer: LinearBase  # its qweight's channel scales and fp32 bias finish the result
    kernels: ModuleType | None

    def dense(self) -> torch.Tensor:
        lin = self.layer
        if self.kernels is None:
            return dequant(self.acc, self.row_scale, lin.scale, lin.bias).to(lin.out_dtype)
        out = torch.empty(self.acc.shape, dtype=lin.out_dtype)
        self.kernels.dequant(out, self.acc, self.row_scale, lin.scale, lin.bias)
        return out


def pack_int8_weight(qweight: torch.Tensor) -> torch.Tensor | None:
    """int8 [K, N] (the GEMM's B operand) -> the CPU kernels' int8_gemm layout [N/8, K/4, 8, 4]: each 32
    bytes hold eight output channels' four consecutive k (csrc/cpu_kernels.cpp). None when K is not a
    multiple of 4 or N of 8 (oneDNN's GEMM runs such a layer)."""
    K, N = qweight.shape
    if K % 4 or N % 8:
        return None
    return qweight.reshape(K // 4, 4, N // 8, 8).permute(2, 0, 3, 1).contiguous()


class Int8LinearMethod(LinearMethodBase):
    """W8A8: y = x @ W.T + b with W int8 per output channel (`layer.qweight` [in, out],
    `layer.scale` fp32 [out], `layer.bias` fp32) and x quantized per row. With the kernels every
    producer of its input (norm, SiLU-and-mul, a previous int8 GEMM's scale-back) is one fused
    kernel that writes int8 rows (see LinearMethodBase).

    The GEMM: `torch._int_mm` (oneDNN), or with `kernel_gemm` (the plan's choice on CPUs without VNNI or
    AMX-INT8) the kernels' int8_gemm over `layer.qweight_packed`, the same exact int32 sums ~30x faster
    there. Where `torch._int_mm` saturates (`int_mm_exact`), `layer.qweight` holds floor(W / 2) and
    `layer.qweight_lo` the rest (0 or 1), and the GEMM is 2 * (x @ hi) + x @ lo: the same sums, at two
    GEMMs' cost."""

    def __init__(self, kernels: ModuleType | None = None, kernel_gemm: bool = False) -> None:
        super().__init__(kernels)
        assert not kernel_gemm or kernels is not None, "the kernels' GEMM needs the kernels"
        self.kernel_gemm = kernel_gemm  # the plan's choice: it checked that these kernels have int8_gemm

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        assert layer.weight is not None, f"{layer.prefix}: no float weight to quantize"
        layer.qweight, layer.scale = quantize_weight(layer.weight)
        layer.qweight_lo = layer.qweight_packed = None
        if self.kernel_gemm:
            layer.qweight_packed = pack_int8_weight(layer.qweight)
        if layer.qweight_packed is not None:
            layer.qweight = None  # one copy of the weights
        elif not int_mm_exact():
            layer.qweight, layer.qweight_lo = split_weight(layer.qweight)
        layer.bias = None if layer.bias is None else layer.bias.float().contiguous()
        layer.weight = None

    def apply_input(self, layer: LinearBase, x: Int8Rows) -> Int8Accumulator:
        if layer.qweight_packed is not None:
            acc = torch.empty((x.q.shape[0], layer.qweight_packed.shape[0] * 8), dtype=torch.int32)
            self.kernels.int8_gemm(acc, x.q.contiguous(), layer.qweight_packed)
            return Int8Accumulator(acc, x.scale, layer, self.kernels)
        acc = torch._int_mm(x.q, layer.qweight)
        if layer.qweight_lo is not None:
            acc = acc.mul_(2).add_(torch._int_mm(x.q, layer.qweight_lo))
        return Int8Accumulator(acc, x.scale, layer, self.kernels)

    def dense_input(self, x: Int8Rows) -> torch.Tensor:
        return x.q.float() * x.scale[:, None]

    def quantize_input(self, x: torch.Tensor) -> Int8Rows:
        if self.kernels is None:
            return Int8Rows(*quantize_rows(x))
        out = _quant_buffers(x.shape[0], x.shape[1])
        self.kernels.quantize_rows(out.q, out.scale, x)
        return out

    def rms_norm_input(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Int8Rows:
        if self.kernels is None:
            return super().rms_norm_input(x, weight, eps)
        out = _quant_buffers(x.shape[0], x.shape[1])
        self.kernels.rms_norm_quant(out.q, out.scale, x, weight, eps)
        return out

    def add_rms_norm_input(self, out: torch.Tensor | PendingOutput, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> Int8Rows:
        if self.kernels is None or not isinstance(out, Int8Accumulator):
            return super().add_rms_norm_input(out, residual, weight, eps)
        x = _quant_buffers(residual.shape[0], residual.shape[1])
        lin = out.layer
        # residual += scale-back(acc); x = quant(norm(residual)), in one pass.
        self.kernels.dequant_add_rms_norm_quant(x.q, x.scale, out.acc, out.row_scale, lin.scale, lin.bias,
                                                residual, weight, eps)
        return x

    def silu_and_mul_input(self, gate_up: torch.Tensor | PendingOutput) -> Int8Rows:
        if self.kernels is None or not isinstance(gate_up, Int8Accumulator):
            return super().silu_and_mul_input(gate_up)
        x = _quant_buffers(gate_up.acc.shape[0], gate_up.acc.shape[1] // 2)
        lin = gate_up.layer
        self.kernels.dequant_silu_mul_quant(x.q, x.scale, gate_up.acc, gate_up.row_scale, lin.scale, lin.bias)
        return x


def get_linear_method(quantization: str | None, kernels: ModuleType | None,
                      int8_gemm: str = "onednn") -> LinearMethodBase:
    """The linear method of a decoder layer for `--quantization` (None: the run dtype); `int8_gemm`:
    the execution plan's GEMM for int8 layers."""
    if quantization is None:
        return UnquantizedLinearMethod(kernels)
    if quantization == "int8":
        return Int8LinearMethod(kernels, kernel_gemm=int8_gemm == "kernels")
    if quantization == "gguf":
        from tokenloom.model.gguf_method import GGUFLinearMethod

        return GGUFLinearMethod(kernels)
    raise ValueError(f"no linear method for quantization={quantization!r}")
