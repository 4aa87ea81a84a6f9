"""Gemma 2 and Gemma 3 (text).

What differs from Llama, all on the layer-loop seams:
* RMSNorm weights are stored as w with the norm scaling by (1 + w): the offset is added at load;
* four norms per layer: the attention and MLP outputs are normalised (post_attention_layernorm,
  post_feedforward_layernorm) before they enter the residual stream, and pre_feedforward_layernorm
  feeds the MLP;
* MLP: down(gelu_tanh(gate) * up) (torch op: no fused GELU-tanh kernel yet);
* attention scale query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the scores (attn_logit_softcapping)
  and the final logits (final_logit_softcapping, in DecoderModel.compute_logits); the embeddings are
  scaled by sqrt(hidden_size) (DecoderModel.forward);
* layers alternate between sliding-window and global attention (config.layer_types);
* Gemma 3: q/k RMSNorm per head ((1 + w) too) and the sliding layers' own rope base
  (rope_local_base_freq), no soft-capping.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.model.attention import AttentionLayerSpec, KVCache
from tokenloom.model.config import ModelConfig
from tokenloom.model.layers import (
    Hidden,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    RMSNorm,
    StepContext,
)
from tokenloom.model.linear import LinearMethodBase, dense
from tokenloom.model.models.qwen3 import QKNormAttention
from tokenloom.model.weight_reader import WeightReader


class GeluTanhMLP(LlamaMLP):
    """down(gelu_tanh(gate) * up): the SiLU-and-mul kernel does not apply; torch ops run it."""

    def __call__(self, x: Any) -> Hidden:
        gate, up = dense(self.gate_up_proj.apply_input(x)).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        return self.down_proj.apply_input(self.down_proj.quant_method.quantize_input(act))


class Gemma2DecoderLayer(LlamaDecoderLayer):
    norm_weight_offset = 1.0  # Gemma's RMSNorm scales by (1 + w); DecoderModel applies it to the final norm
    torch_ops = ("the GELU-tanh MLP activation", "the post-attention / post-MLP norms")

    def __init__(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 layer_idx: int = 0) -> None:
        super().__init__(config, get, prefix, method, layer_idx)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(get(prefix + "input_layernorm.weight") + 1.0, eps)
        self.pre_feedforward_layernorm = RMSNorm(get(prefix + "pre_feedforward_layernorm.weight") + 1.0, eps)
        # Plain norms of a sublayer's output (not the next linear's input): weights for F.rms_norm.
        self.post_attention_weight = get(prefix + "post_attention_layernorm.weight") + 1.0
        self.post_feedforward_weight = get(prefix + "post_feedforward_layernorm.weight") + 1.0
        self.eps = eps

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """Gemma's post_attention_layernorm normalises the attention output; the MLP reads this one."""
        return self.pre_feedforward_layernorm

    def make_mlp(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 layer_idx: int) -> Any:
        return GeluTanhMLP(get, prefix, method)

    def attention_spec(self, config: ModelConfig, layer_idx: int) -> AttentionLayerSpec:
        scalar = config.query_pre_attn_scalar or config.head_dim
        return AttentionLayerSpec(scale=float(scalar) ** -0.5, window=config.layer_window(layer_idx),
                                  softcap=config.attn_logit_softcapping)

    def __call__(self, hidden: Hidden | None, residual: torch.Tensor, ctx: StepContext, kv_cache: KVCache | None,
                 last_layer: bool) -> tuple[Hidden | None, torch.Tensor]:
        """As LlamaDecoderLayer, but the returned MLP output is already post-normalised (the next
        layer's input norm adds it into the residual)."""
        x = self.input_layernorm(hidden, residual, self.self_attn.qkv_proj.quant_method)
        attn_out, rows = self.self_attn(x, ctx, kv_cache, last_layer)
        if rows is not None:
            residual = residual.index_select(0, rows)
        if attn_out is None:
            return None, residual
        w = self.post_attention_weight
        attn_out = F.rms_norm(dense(attn_out), w.shape, w, self.eps)
        x = self.pre_feedforward_layernorm(attn_out, residual, self.mlp.gate_up_proj.quant_method)
        w = self.post_feedforward_weight
        return F.rms_norm(dense(self.mlp(x)), w.shape, w, self.eps), residual


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    torch_ops = (*Gemma2DecoderLayer.torch_ops, "the q/k RMSNorm")

    def make_attention(self, config: ModelConfig, get: WeightReader, prefix: str,
                       method: LinearMethodBase) -> LlamaAttention:
        return QKNormAttention(config, get, prefix, method, weight_offset=1.0)

    def attention_spec(self, config: ModelConfig, layer_idx: int) -> AttentionLayerSpec:
        spec = super().attention_spec(config, layer_idx)
        # Sliding layers rotate with the local base (DecoderModel builds those tables), by their layer type: with
        # disable_sliding_window they attend to everything but keep their rope (vLLM's Gemma 3).
        self.self_attn.local_rope = config.is_sliding_layer(layer_idx) and config.rope_local_base_freq is not None
        return spec
