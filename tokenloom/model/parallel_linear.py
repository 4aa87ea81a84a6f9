"""The tensor-parallel linears' one difference from LinearBase (vLLM's RowParallelLinear): a
row-parallel linear's rank holds a slice of the input features, so its GEMM gives a partial sum,
and one all-reduce over the TP group completes it. Column-parallel linears (q/k/v, gate/up, the
vocab-parallel head) need no class of their own: their weights are cut by output rows
(tokenloom/model/tp_shard.py) and each rank's result is its slice.

The all-reduce runs on the finished (dense) output, whatever the quant method: an int8 layer's int32
accumulators are scaled back first, so the sum is over the run dtype, as vLLM's."""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.distributed import tensor_model_parallel_all_reduce
from tokenloom.model.linear import LinearBase, PendingOutput, dense

# The HF names of the row-parallel linears of a Llama-style layer (everything else is column-cut).
ROW_PARALLEL = ("o_proj", "down_proj")


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_slice @ W_slice.T) (+ the bias, which rank 0 alone holds)."""

    def apply_input(self, x: Any) -> torch.Tensor | PendingOutput:
        return tensor_model_parallel_all_reduce(dense(self.quant_method.apply_input(self, x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, self.bias))

    __call__ = forward
