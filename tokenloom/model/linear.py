"""Linear layers and how they compute: vLLM's shape, `LinearBase.forward -> quant_method.apply`.

A `LinearBase` holds a weight (and bias); *how* y = x @ W.T + b is computed lives in its
`LinearMethodBase`, one object shared by the layers that compute the same way:

* `UnquantizedLinearMethod` (here): run-dtype GEMMs, F.linear, or oneDNN with the weight pre-packed
  once into its blocked layout (CPU bf16, run at bucketed row counts: see tokenloom/core/gemm_rows.py);
* `Int8LinearMethod` (tokenloom/model/quant.py): W8A8, int8 weights per output channel, activations
  quantized per row.

A new weight format (e.g. GGUF block-quantized kernels) or a sharded (tensor-parallel) linear is a
new method object; the network's layer loop (tokenloom/model/decoder_model.py) does not change.

The fused seam. With the compiled CPU kernels, the activation a norm or SiLU-and-mul produces goes
straight into the next GEMM in the format that GEMM wants (int8 rows + row scales for W8A8), and a
GEMM's result may leave unfinished (int8: int32 accumulators + row scales) for the next kernel to
scale back in its own pass. So a method also says how to produce its input: `rms_norm_input`,
`add_rms_norm_input`, `silu_and_mul_input` and `quantize_input` return the activation in its
format, and the fused kernels they run are the method's choice. `apply_input` runs the GEMM on
such an activation and returns a tensor or a `PendingOutput`; `dense()` finishes either.
Without the kernels (`kernels=None`: CUDA, or no compiler) the same hooks run plain torch ops.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom import envs
from tokenloom.core.gemm_rows import packed_rows

logger = logging.getLogger(__name__)


class PendingOutput(ABC):
    """A GEMM result the producing method has not finished (e.g. int32 accumulators)."""

    @abstractmethod
    def dense(self) -> torch.Tensor:
        """The finished output in the run dtype, a fresh tensor."""


def dense(out: torch.Tensor | PendingOutput) -> torch.Tensor:
    """Any linear's output as a run-dtype tensor."""
    return out if isinstance(out, torch.Tensor) else out.dense()


class LinearMethodBase(ABC):
    """How a linear computes (see the module docstring). `kernels`: the compiled CPU kernels
    module, or None for plain torch ops."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        self.kernels = kernels

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Convert the layer's float weight into what `apply_input` reads (once, at load)."""
        return None

    @abstractmethod
    def apply_input(self, layer: LinearBase, x: Any) -> torch.Tensor | PendingOutput:
        """The GEMM of an activation already in this method's input format."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Run-dtype x -> run-dtype y (the bias is the layer's; the argument mirrors vLLM's)."""
        return dense(self.apply_input(layer, self.quantize_input(x)))

    # ---------------------------------------------------------------- producing this method's input

    def quantize_input(self, x: torch.Tensor) -> Any:
        """A run-dtype activation in this method's input format (unquantized: itself)."""
        return x

    def dense_input(self, x: Any) -> torch.Tensor:
        """An activation in this method's input format as a float tensor (the inverse of
        `quantize_input`, up to its rounding): what a LoRA adapter's shrink reads."""
        return x

    def rms_norm_input(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Any:
        """RMSNorm(x), in this method's input format."""
        if self.kernels is None:
            # torch's kernel accumulates in fp32 and rounds once (in bf16 slightly more accurate than HF's).
            return self.quantize_input(F.rms_norm(x, weight.shape, weight, eps))
        y = torch.empty_like(x)
        self.kernels.rms_norm(y, x, weight, eps)
        return self.quantize_input(y)

    def add_rms_norm_input(self, out: torch.Tensor | PendingOutput, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> Any:
        """residual += out (in place); RMSNorm(residual) in this method's input format."""
        x = dense(out)
        if self.kernels is None:
            residual += x
            return self.quantize_input(F.rms_norm(residual, weight.shape, weight, eps))
        self.kernels.fused_add_rms_norm(x, residual, weight, eps)  # x becomes the norm
        return self.quantize_input(x)

    def silu_and_mul_input(self, gate_up: torch.Tensor | PendingOutput) -> Any:
        """silu(gate) * up of a fused gate/up output [T, 2 I], in this method's input format."""
        y = dense(gate_up)
        if self.kernels is None:
            gate, up = y.chunk(2, dim=-1)
            return self.quantize_input(F.silu(gate) * up)
        act = torch.empty(y.shape[0], y.shape[1] // 2, dtype=y.dtype)
        self.kernels.silu_and_mul(act, y)
        return self.quantize_input(act)


class LinearBase:
    """y = x @ weight.T + bias, computed by `quant_method`. `prefix`: the weight's HF-style name
    (without `.weight`), for messages and calibration statistics."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, quant_method: LinearMethodBase,
                 prefix: str = "", out_dtype: torch.dtype | None = None) -> None:
        self.weight = weight  # [out, in]; a method may replace or drop it in process_weights_after_loading
        self.bias = bias
        self.quant_method = quant_method
        self.prefix = prefix
        self.out_dtype = out_dtype if out_dtype is not None else (weight.dtype if weight is not None else None)
        self.packed: torch.Tensor | None = None  # UnquantizedLinearMethod: oneDNN's pre-packed weight
        # A LoRA target (tokenloom/lora/models.py LoRALinear): adds the step's adapters' deltas to the
        # output when a row of the step runs one. None: no adapter can target this linear.
        self.lora: Any = None
        # SmoothQuant's folds (tokenloom/model/smoothquant.py): (input channel factors s, the input being
        # x / s; output row divisors d, the output being y / d), either None; a LoRA delta undoes them.
        self.lora_scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    __call__ = forward

    def apply_input(self, x: Any) -> torch.Tensor | PendingOutput:
        """The GEMM of an activation already in the method's input format (the fused seam). With
        LoRA adapters in the step, the base output is finished and their deltas added to it."""
        out = self.quant_method.apply_input(self, x)
        if self.lora is not None and self.lora.punica.active:
            return self.lora.apply(out, x, self.quant_method)
        return out

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Switch to `method` and let it convert the (float) weight."""
        self.quant_method = method
        method.process_weights_after_loading(self)


class UnquantizedLinearMethod(LinearMethodBase):
    """Run-dtype GEMMs: F.linear, or oneDNN on a pre-packed weight (`prepack_linears`), which
    skips the per-call reorder: 5-30 % faster GEMMs here."""

    # Row counts the compiled skinny fp32 GEMM takes (each weight row read once for up to 8 rows):
    # speculative decoding's 1 + K verification rows and small decode batches, which BLAS runs at
    # ~m times the cost of one row on this CPU (AVX2) while the weights stream from memory.
    SKINNY_ROWS = range(2, 17)

    def apply_input(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is None:
            if (self.kernels is not None and x.dtype == torch.float32 and x.shape[0] in self.SKINNY_ROWS
                    and x.is_contiguous() and layer.weight is not None and layer.weight.is_contiguous()):
                out = x.new_empty((x.shape[0], layer.weight.shape[0]))
                self.kernels.skinny_linear(out, x, layer.weight, layer.bias)
                return out
            return F.linear(x, layer.weight, layer.bias)
        m = x.shape[0]
        rows = packed_rows(m)
        if rows == m:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        padded = x.new_zeros((rows, x.shape[1]))
        padded[:m].copy_(x)
        return torch.ops.mkldnn._linear_pointwise(padded, layer.packed, layer.bias, "none", [], "")[:m]

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.apply_input(layer, x)


# --------------------------------------------------------------------------- oneDNN pre-packing


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN weight pre-packing on CPU for bf16 and float32 (vLLM's CPU build sends every dtype's
    unquantized GEMM to oneDNN too, `create_onednn_mm`); off with TOKENLOOM_PACKED_LINEAR=0.

    float32 used to stay on F.linear (MKL). Measured on an AVX2 AMD EPYC, oneDNN's packed float32
    GEMMs are 1.3-3x MKL's at decode-sized M (the default model's LM head at M=8: 19.6 -> 6.5 ms) and
    equal from M=128: single-stream decode 44 -> 29 ms a token, 32 streams 1.24x (docs/performance.md)."""
    if not envs.TOKENLOOM_PACKED_LINEAR:
        return False
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available())


def pack_linear(lin: LinearBase, batch_hint: int = 128, check: bool = False) -> bool:
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


def prepack_linears(lins: list[LinearBase]) -> bool:
    """Pre-pack every one of these unquantized linears, or none (a partial failure leaves all on
    F.linear). True if packed."""
    # The first one is checked against F.linear: the API is private, a torch upgrade could change it.
    if all(pack_linear(lin, check=i == 0) for i, lin in enumerate(lins)):
        for lin in lins:
            lin.weight = None  # the packed copy replaces it (a tied lm_head's lives on as embed_tokens)
        return True
    for lin in lins:
        lin.packed = None
    logger.warning("oneDNN weight pre-packing is unavailable here; using F.linear")
    return False
