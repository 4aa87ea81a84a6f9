"""GGUF for the families beyond Llama/Qwen2: llama.cpp's architecture keys, tensor names and
metadata (gguf-py's constants, convert_hf_to_gguf.py's conventions) mapped onto tokenloom's HF-named
weights and ModelConfig fields. gguf.py calls in here; nothing here parses files.

Conventions undone at load:
* Gemma 2/3: llama.cpp stores every RMSNorm weight as 1 + w (its norm multiplies by the weight);
  the HF weights are w, so 1 is subtracted back. The attention scale is head_dim ** -0.5 (llama.cpp's
  choice; HF's query_pre_attn_scalar equals head_dim for the released models but the 27B).
* Qwen3-MoE: experts come stacked ([E, I, H] per projection); they are split into HF's per-expert
  names. llama.cpp always renormalises the top-k weights for this architecture.
* Phi-3: the fused attn_qkv / ffn_up (gate then up) are split like the HF checkpoint's.
* Mistral: llama.cpp's converter writes Mistral as a "llama" GGUF and keeps no sliding window, so a
  Mistral GGUF loads as Llama (full attention).
* Mixtral: a "llama" GGUF with `llama.expert_count` (llama.cpp's converter subclasses Llama: q/k rows
  permuted, no sliding window kept); its experts come stacked as Qwen3-MoE's, of feed_forward_length,
  and llama.cpp renormalises the top-k weights. GGUFs from before the stacked layout (one tensor per
  expert, `ffn_gate.N`) are refused, naming the tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.model.config import FULL, SLIDING

# GGUF general.architecture -> ModelConfig.architecture
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}

_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_EXPERTS = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
            "ffn_up_exps.weight": "mlp.experts.up_proj.weight", "ffn_down_exps.weight": "mlp.experts.down_proj.weight"}
_GEMMA = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
          "post_attention_norm.weight": "post_attention_layernorm.weight",
          "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Per architecture: llama.cpp block tensor names that differ from (or add to) Llama's.
BLOCK_NAMES: dict[str, dict[str, str]] = {
    "qwen3": _QK_NORMS,
    "qwen3_moe": {**_QK_NORMS, **_EXPERTS},
    "mixtral": _EXPERTS,
    "gemma2": _GEMMA,
    "gemma3": {**_GEMMA, **_QK_NORMS},
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Families whose llama.cpp converter permutes the q/k rows (LlamaModel.permute), undone at load.
ROPE_PERMUTED = ("llama", "mixtral")


def gguf_model_architecture(meta: dict[str, Any], gguf_arch: str) -> str:
    """ModelConfig.architecture of a GGUF: its general.architecture's, but a "llama" with experts is Mixtral."""
    if gguf_arch == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        return "mixtral"
    return GGUF_ARCHITECTURES[gguf_arch]


def family_config_fields(meta: dict[str, Any], gguf_arch: str, arch: str, num_layers: int, head_dim: int,
                         tensors: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields beyond Llama's, from the architecture's metadata keys."""
    def key(suffix: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{suffix}", default)

    fields: dict[str, Any] = {}
    window = key("attention.sliding_window")
    if arch in ("gemma2", "gemma3", "phi3") and window:
        fields["sliding_window"] = int(window)
        if arch == "gemma2":
            fields["layer_types"] = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
        elif arch == "gemma3":
            pattern = key("attention.sliding_window_pattern", 6)
            if isinstance(pattern, list):  # one bool per layer: sliding or not
                fields["layer_types"] = [SLIDING if p else FULL for p in pattern]
            else:
                fields["layer_types"] = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]
    if arch.startswith("gemma"):
        fields.update(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=float(head_dim))
        fields["final_logit_softcapping"] = key("final_logit_softcapping")
        if arch == "gemma2":
            fields["attn_logit_softcapping"] = key("attn_logit_softcapping")
        else:
            fields["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    if arch == "qwen3_moe":
        for suffix in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
            if key(suffix) is None:
                raise ValueError(f"GGUF metadata lacks required key '{gguf_arch}.{suffix}'")
        fields.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      norm_topk_prob=bool(key("expert_weights_norm", True)))
    if arch == "mixtral":
        if key("expert_used_count") is None:
            raise ValueError(f"GGUF metadata lacks required key '{gguf_arch}.expert_used_count'")
        fields.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length")),
                      norm_topk_prob=True)
    if arch == "phi3" and all(t in tensors for t in ROPE_FACTOR_TENSORS):
        original = key("rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"GGUF has LongRoPE factors but no '{gguf_arch}.rope.scaling.original_context_length'")
        fields["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
    return fields


def finish_family_weights(config: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo llama.cpp's storage conventions (see the module docstring); returns HF-named weights."""
    arch = config.architecture
    if arch.startswith("gemma"):
        for name in weights:
            if name.endswith("norm.weight"):
                weights[name] = weights[name] - 1.0
    if arch in ("qwen3_moe", "mixtral"):
        for name in [n for n in weights if ".mlp.experts." in n]:
            stacked = weights.pop(name)
            prefix, proj = name.split(".mlp.experts.")
            if stacked.dim() != 3 or stacked.shape[0] != config.num_experts:
                raise ValueError(f"GGUF expert tensor for {name} has shape {tuple(stacked.shape)}, "
                                 f"expected [{config.num_experts}, ...]")
            for j in range(stacked.shape[0]):
                weights[f"{prefix}.mlp.experts.{j}.{proj}"] = stacked[j]
    if arch == "phi3":
        from tokenloom.model.hf import split_phi3_fused

        weights = split_phi3_fused(weights, config)
    return weights
