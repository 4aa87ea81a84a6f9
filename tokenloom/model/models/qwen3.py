"""Qwen3: Llama's layout plus an RMSNorm over each q and k head before rotary (q_norm, k_norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.model.config import ModelConfig
from tokenloom.model.layers import LlamaAttention, LlamaDecoderLayer
from tokenloom.model.linear import LinearMethodBase
from tokenloom.model.weight_reader import WeightReader


def per_head_rms_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                      num_kv_heads: int, eps: float) -> torch.Tensor:
    """RMSNorm of each q and each k head of a fused qkv output [T, (Hq + 2 Hkv) * D] (v untouched).
    A torch op: no fused kernel for it yet (it is two small elementwise passes per layer)."""
    d = q_weight.shape[0]
    t = qkv.shape[0]
    q = F.rms_norm(qkv[:, : num_q_heads * d].reshape(t, num_q_heads, d), (d,), q_weight, eps)
    k = F.rms_norm(qkv[:, num_q_heads * d : (num_q_heads + num_kv_heads) * d].reshape(t, num_kv_heads, d), (d,),
                   k_weight, eps)
    return torch.cat((q.reshape(t, -1), k.reshape(t, -1), qkv[:, (num_q_heads + num_kv_heads) * d :]), dim=1)


class QKNormAttention(LlamaAttention):
    """Attention whose q and k heads are RMS-normalised before rotary (weights [head_dim])."""

    def __init__(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 weight_offset: float = 0.0) -> None:
        super().__init__(get, prefix, method)
        self.q_norm = get(prefix + "q_norm.weight") + weight_offset
        self.k_norm = get(prefix + "k_norm.weight") + weight_offset
        self.heads = (config.num_attention_heads, config.num_key_value_heads)
        self.eps = config.rms_norm_eps

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        return per_head_rms_norm(qkv, self.q_norm, self.k_norm, *self.heads, self.eps)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    torch_ops = ("the q/k RMSNorm",)

    def make_attention(self, config: ModelConfig, get: WeightReader, prefix: str,
                       method: LinearMethodBase) -> LlamaAttention:
        return QKNormAttention(config, get, prefix, method)
