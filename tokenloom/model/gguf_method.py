"""`--quantization gguf`: the linear method of layers whose weights stay GGUF blocks.

A layer carries a `GGUFLinear` (tokenloom/model/gguf_weights.py) as `layer.gguf`; the method's input
format is the plain run-dtype activation, so the norms and SiLU-and-mul before it are the base
class's (the compiled CPU kernels in the run dtype). The GEMM itself is the GGUF kernels' quantized
GEMV / small GEMM, or dequantize-then-GEMM for large batches (GGUFLinear decides by row count).
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenloom.model.linear import LinearBase, LinearMethodBase


class GGUFLinearMethod(LinearMethodBase):
    """`kernels`: the CPU kernels (norms, SiLU-and-mul); `gguf_kernels`: the GGUF GEMMs (None: the
    layers dequantize on every call, slow but correct)."""

    def __init__(self, kernels: ModuleType | None = None) -> None:
        super().__init__(kernels)
        from tokenloom.model.gguf_kernels import gguf_kernels

        self.gguf_kernels = gguf_kernels()

    def apply_input(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        # The kernels sum in fp32 and write the layer's out_dtype from those sums (an fp32 head keeps them).
        return layer.gguf(x, out_dtype=layer.out_dtype)  # type: ignore[attr-defined]

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.apply_input(layer, x)
