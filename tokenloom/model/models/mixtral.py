"""Mixtral: Llama's (Mistral's) attention, sliding window where the config sets one, with a sparse
mixture-of-experts MLP in every layer.

Routing as transformers' MixtralSparseMoeBlock and vLLM's fused MoE with renormalize=True: softmax of the
router logits (fp32), top-k, the k weights renormalised to sum to one — the same rule as Qwen3-MoE with
norm_topk_prob, so the router and the grouped experts are qwen3_moe.py's. Checkpoints name the experts
`block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down) and the router `block_sparse_moe.gate`; they are
renamed at load (tokenloom/model/hf.py: rename_mixtral) to the names SparseMoeMLP reads.
"""

from __future__ import annotations

from typing import Any

from tokenloom.model.config import ModelConfig
from tokenloom.model.layers import LlamaDecoderLayer
from tokenloom.model.linear import LinearBase, LinearMethodBase
from tokenloom.model.models.qwen3_moe import SparseMoeMLP
from tokenloom.model.weight_reader import WeightReader


class MixtralDecoderLayer(LlamaDecoderLayer):
    int8_supported = False  # the experts are no gate/up linear for SmoothQuant to fold into
    torch_ops = ("the routed experts (grouped torch matmuls)",)

    def make_mlp(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 layer_idx: int) -> Any:
        return SparseMoeMLP(config, get, prefix, method)

    def linears(self) -> dict[str, LinearBase]:
        return {"qkv_proj": self.self_attn.qkv_proj, "o_proj": self.self_attn.o_proj, "gate": self.mlp.gate}
