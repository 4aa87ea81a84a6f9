"""WeightReader: fetches a checkpoint's HF-named weights for the layers being built, cast to the run
dtype and moved to the device, and turns the loader's GGUF blocks into GGUF-method linears; plus the
GGUF embedding lookup."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.model.linear import LinearBase, LinearMethodBase
from tokenloom.model.parallel_linear import ROW_PARALLEL, RowParallelLinear


class WeightReader:
    """Fetches HF-named weights, cast to the run dtype and moved to the device. With `gguf_method`,
    weights the loader kept as GGUF blocks (GGUFWeight) become linears of that method instead."""

    def __init__(self, weights: dict[str, Any], device: torch.device, dtype: torch.dtype,
                 gguf_method: LinearMethodBase | None = None, row_parallel: bool = False) -> None:
        self.weights, self.device, self.dtype = weights, device, dtype
        self.gguf_method = gguf_method
        # Tensor parallel: o_proj / down_proj hold input slices and all-reduce their outputs.
        self.row_parallel = row_parallel

    def _linear_class(self, name: str) -> type[LinearBase]:
        return RowParallelLinear if self.row_parallel and name.rsplit(".", 1)[-1] in ROW_PARALLEL else LinearBase

    def linear(self, prefixes: list[str], method: LinearMethodBase, name: str, bias: bool = True) -> LinearBase:
        """One linear over the row-concatenated weights `<prefix>.weight` (and biases, when present)."""
        weights = [p + ".weight" for p in prefixes]
        biases = [p + ".bias" for p in prefixes] if bias else []
        if self.gguf_method is not None and all(is_gguf_weight(self.weights.get(n)) for n in weights):
            from tokenloom.model.gguf_weights import GGUFLinear

            lin = self._linear_class(name)(None, None, self.gguf_method, name, self.dtype)
            lin.gguf = GGUFLinear.from_weights([self.weights[n] for n in weights],  # type: ignore[attr-defined]
                                               [self.weights.get(b) for b in biases] or [None] * len(weights),
                                               self.gguf_method.gguf_kernels)  # type: ignore[attr-defined]
            return lin
        weight = self(weights[0]) if len(weights) == 1 else self.cat(weights)
        b = (self.optional(biases[0]) if len(biases) == 1 else self.cat_optional(biases)) if biases else None
        return self._linear_class(name)(weight, b, method, name, self.dtype)

    def raw_or_converted(self, name: str) -> Any:
        """A GGUFWeight as it is (with the GGUF method), else the converted tensor."""
        value = self.weights.get(name)
        return value if self.gguf_method is not None and is_gguf_weight(value) else self(name)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return self._convert(self.weights[name])

    def optional(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.weights else None

    def cat(self, names: list[str]) -> torch.Tensor:
        # Each part converted first: a linear may hold GGUF blocks beside a float part (an F16 / F32 matrix
        # in a quantized file, as some llama.cpp mixes write), which then runs as one float matrix.
        return torch.cat([self(n) for n in names], dim=0)

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

    def _convert(self, t: Any) -> torch.Tensor:
        if is_gguf_weight(t):  # a GGUFWeight where a float tensor is needed (no GGUF method, or a mixed linear)
            t = t.dequantize()
        return t.detach().to(device=self.device, dtype=self.dtype).contiguous()


def is_gguf_weight(value: Any) -> bool:
    from tokenloom.model.gguf_weights import GGUFWeight

    return isinstance(value, GGUFWeight)


def gguf_embedding(weight: Any, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a GGUF embedding table, dequantized to `dtype`."""
    from tokenloom.model.gguf_kernels import gguf_kernels

    kernels = gguf_kernels()
    if kernels is None:
        return F.embedding(input_ids, weight.dequantize(dtype))
    out = torch.empty(input_ids.shape[0], weight.shape[1], dtype=dtype)
    embedding = kernels.gguf_embedding_packed if weight.packed8 else kernels.gguf_embedding
    embedding(out, weight.data, weight.qtype, input_ids.long().contiguous())
    return out

