"""Qwen3-MoE: Qwen3's attention with a sparse mixture-of-experts MLP.

Routing as transformers' Qwen3MoeTopKRouter: softmax of the router logits in fp32, top-k
(torch.topk: among equal probabilities the lower expert index wins), renormalised over the k when
`norm_topk_prob`. The experts run grouped by expert, as vLLM's fused MoE does: the (token, slot)
pairs are sorted by expert once, and each expert that received tokens runs one gate/up GEMM, SiLU
and one down GEMM over its rows; the weighted outputs are summed into each token with index_add.
An expert that receives no token costs nothing. There are no shared experts in Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.model.config import ModelConfig
from tokenloom.model.layers import Hidden, LlamaMLP
from tokenloom.model.linear import LinearBase, LinearMethodBase, dense
from tokenloom.model.models.qwen3 import Qwen3DecoderLayer
from tokenloom.model.weight_reader import WeightReader


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """x [T, H]; routing weights/ids [T, k]; expert weights [E, 2 I, H], [E, H, I] -> [T, H]."""
    out = torch.zeros_like(x)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    token_of = order // experts.shape[1]
    pair_weight = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        gate, up = F.linear(x.index_select(0, rows), w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * pair_weight[start : start + n, None]
        out.index_add_(0, rows, y)
        start += n
    return out


class SparseMoeMLP:
    """Router + experts. The router is a LinearBase (so it is listed with the layer's linears); the
    experts stay stacked [E, ...] run-dtype tensors (int8 does not cover them)."""

    def __init__(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase) -> None:
        self.gate = LinearBase(get(prefix + "gate.weight"), None, method, prefix + "gate", get.dtype)
        n = config.num_experts
        e = prefix + "experts."
        self.w_gate_up = torch.stack([get.cat([f"{e}{i}.gate_proj.weight", f"{e}{i}.up_proj.weight"])
                                      for i in range(n)])
        self.w_down = torch.stack([get(f"{e}{i}.down_proj.weight") for i in range(n)])
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob

    @property
    def gate_up_proj(self) -> LinearBase:
        """The linear that reads this MLP's input (the router): the layer's norm asks its method
        for the input format, as it asks a dense MLP's gate_up_proj."""
        return self.gate

    def __call__(self, x: Any) -> Hidden:
        x = dense(x)
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        return grouped_experts(x, weights, experts, self.w_gate_up, self.w_down)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    int8_supported = False  # the experts are no gate/up linear for SmoothQuant to fold into
    torch_ops = ("the q/k RMSNorm", "the routed experts (grouped torch matmuls)")

    def make_mlp(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 layer_idx: int) -> Any:
        if config.is_moe_layer(layer_idx):
            return SparseMoeMLP(config, get, prefix, method)
        return LlamaMLP(get, prefix, method)

    def linears(self) -> dict[str, LinearBase]:
        if not isinstance(self.mlp, SparseMoeMLP):
            return super().linears()
        return {"qkv_proj": self.self_attn.qkv_proj, "o_proj": self.self_attn.o_proj, "gate": self.mlp.gate}
