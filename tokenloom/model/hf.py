"""Hugging Face model directories: config.json → ModelConfig, *.safetensors → weights in HF naming."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tokenloom.model.config import FULL, SLIDING, SUPPORTED_ARCHITECTURES, ModelConfig
from tokenloom.model.hf_overrides import ModelOverrides, note_dropped_layers
from tokenloom.model.rotary import rope_inv_freq

_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
}
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
# The activation each family's MLP runs (the config's hidden_act / hidden_activation must say so).
_ACTIVATION = {"gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh"}
# Fields a family cannot run without (beyond the Llama ones every config has).
_REQUIRED = {
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "gemma2": ("query_pre_attn_scalar",),
    "gemma3": ("query_pre_attn_scalar",),
}
_COMMON_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_hf_dir(path: Path, overrides: ModelOverrides | None = None) -> ModelConfig:
    """A Hugging Face directory's ModelConfig: its config.json, with the engine's hf_overrides and
    disable_sliding_window applied (tokenloom/model/hf_overrides.py)."""
    cfg = json.loads((path / "config.json").read_text())
    if overrides is None:
        return config_from_hf(cfg, name=path.name)
    return overrides.finish(config_from_hf(overrides.hf_config(cfg), name=path.name))


def load_hf_dir(path: Path, dtype: torch.dtype,
                overrides: ModelOverrides | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`overrides`: the engine's hf_overrides / disable_sliding_window; layers past an overridden
    num_hidden_layers are not read."""
    from safetensors import safe_open

    config = config_from_hf_dir(path, overrides)
    weights: dict[str, torch.Tensor] = {}
    dropped = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _ignored_hf_tensor(name, config):
                    continue
                if overrides is not None and overrides.drops_tensor(name, config):
                    dropped += 1
                    continue
                if name in weights:
                    raise ValueError(f"{path}: tensor {name!r} appears in more than one safetensors file")
                weights[name] = f.get_tensor(name).to(dtype)
    note_dropped_layers(path, config, overrides, dropped)
    if config.architecture == "phi3":
        weights = split_phi3_fused(weights, config)
    if config.architecture == "mixtral":
        weights = rename_mixtral(weights)
    return config, weights


_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def rename_mixtral(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's `block_sparse_moe.gate` / `.experts.N.w1|w3|w2` → the names the MoE MLP reads
    (`mlp.gate`, `mlp.experts.N.gate_proj|up_proj|down_proj`, as Qwen3-MoE's)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            head, _, tail = name.rpartition(".experts.")
            if head:
                index, proj, rest = tail.split(".", 2)
                name = f"{head}.experts.{index}.{_MIXTRAL_EXPERT.get(proj, proj)}.{rest}"
        out[name] = t
    return out


def split_phi3_fused(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3 stores qkv_proj and gate_up_proj fused: split them into Llama's names (the Llama layer
    fuses them again, so this costs a copy at load only)."""
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            if t.shape[0] != q_dim + 2 * kv_dim:
                raise ValueError(f"{name} has {t.shape[0]} rows, the config implies {q_dim + 2 * kv_dim}")
            p = name.removesuffix("qkv_proj.weight")
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = \
                t.split([q_dim, kv_dim, kv_dim])
        elif name.endswith("mlp.gate_up_proj.weight"):
            if t.shape[0] != 2 * config.intermediate_size:
                raise ValueError(f"{name} has {t.shape[0]} rows, the config implies {2 * config.intermediate_size}")
            p = name.removesuffix("gate_up_proj.weight")
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t.chunk(2)
        else:
            out[name] = t
    return out


def _ignored_hf_tensor(name: str, config: ModelConfig) -> bool:
    # Older checkpoints saved rotary buffers; tied checkpoints sometimes store lm_head anyway.
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def config_from_hf(cfg: dict[str, Any], name: str = "model", *, check_rope: bool = True) -> ModelConfig:
    """Build a `ModelConfig` from a parsed Hugging Face config.json. `check_rope` False: the rope tables are not
    built to check the rope_scaling (a GGUF's config, whose LongRoPE factors come with its tensors later)."""
    arch = _hf_architecture(cfg)
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:  # transformers v5 spelling
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
    for key in _COMMON_REQUIRED + _REQUIRED.get(arch, ()):
        if cfg.get(key) is None:
            raise ValueError(f"config.json has no {key!r}, which a {arch} model needs")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act != _ACTIVATION.get(arch, "silu"):
        raise ValueError(f"unsupported hidden_act {act!r} for {arch}; tokenloom implements "
                         f"{_ACTIVATION.get(arch, 'silu')} for it")
    heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling, local_theta = _hf_rope(cfg)
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"unsupported partial_rotary_factor {partial}; tokenloom rotates the whole head")
    window, layer_types = _hf_sliding_window(cfg, arch)
    if arch == "phi3" and cfg.get("original_max_position_embeddings"):
        cfg.setdefault("_extra", {})["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    eos, extra = cfg.get("eos_token_id"), dict(cfg.get("_extra", {}))
    for key in ("decoder_sparse_step", "mlp_only_layers"):
        if key in cfg:
            extra[key] = cfg[key]
    if isinstance(eos, list):  # e.g. Llama 3 stops on several ids
        extra["eos_token_ids"] = eos
        eos = eos[0] if eos else None
    config = ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        # Llama/Qwen/Mistral/Phi-3 configs default to untied, Gemma's to tied.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.startswith("gemma"))),
        # Qwen2 always has q/k/v biases and its config has no flag for it.
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        name=name,
        sliding_window=window,
        layer_types=layer_types,
        hidden_act=act,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "gemma2" else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if arch.startswith("gemma") else None,
        rope_local_base_freq=local_theta if arch == "gemma3" else None,
        num_experts=int(cfg["num_experts"]) if arch == "qwen3_moe" else
        int(cfg["num_local_experts"]) if arch == "mixtral" else 0,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if arch in ("qwen3_moe", "mixtral") else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if arch == "qwen3_moe" else
        int(cfg["intermediate_size"]) if arch == "mixtral" else 0,
        # Mixtral always renormalises the top-k weights (transformers' MixtralSparseMoeBlock, vLLM's renormalize).
        norm_topk_prob=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
        extra=extra,
    )
    if check_rope:
        rope_inv_freq(config)  # an unknown rope_scaling type fails here, naming it, before any weight is read
    return config


def override_gguf_config(config: ModelConfig, overrides: ModelOverrides) -> ModelConfig:
    """A GGUF's ModelConfig (from its metadata) with the engine's overrides: hf_overrides on its config in Hugging
    Face's names, read back as a directory's config.json is read; then disable_sliding_window."""
    if overrides.hf_overrides:
        overridden = config_from_hf(overrides.hf_config(hf_dict_from_config(config)), name=config.name,
                                    check_rope=False)
        config = replace(overridden, extra={**config.extra, **overridden.extra})
    return overrides.finish(config)


# ModelConfig.architecture -> (HF model_type, architectures[0]): what hf_dict_from_config writes.
_HF_NAMES = {arch: ("gemma3_text" if arch == "gemma3" else arch, cls) for cls, arch in _HF_ARCHITECTURES.items()}


def hf_dict_from_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json that `config_from_hf` reads back as `config`: a GGUF's metadata in Hugging Face's
    names, the config vLLM's hf_overrides edit for a GGUF (transformers gives it one made from the metadata)."""
    arch = config.architecture
    model_type, cls = _HF_NAMES[arch]
    eos: Any = config.extra.get("eos_token_ids", config.eos_token_id)
    cfg: dict[str, Any] = {
        "model_type": model_type, "architectures": [cls], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias, "bos_token_id": config.bos_token_id, "eos_token_id": eos,
        "hidden_act": config.hidden_act,
    }
    if config.rope_scaling is not None:
        cfg["rope_scaling"] = dict(config.rope_scaling)
        if "original_max_position_embeddings" in config.rope_scaling:
            cfg["original_max_position_embeddings"] = config.rope_scaling["original_max_position_embeddings"]
    if config.sliding_window is not None:
        cfg["sliding_window"] = config.sliding_window
        layer_types = config.layer_types
        if arch in ("qwen2", "qwen3", "qwen3_moe"):  # their window counts only with use_sliding_window
            cfg["use_sliding_window"] = True
            layer_types = layer_types or [SLIDING] * config.num_hidden_layers
        if layer_types is not None:
            cfg["layer_types"] = list(layer_types)
    if arch.startswith("gemma"):  # transformers types it int (a GGUF's, head_dim, comes as a float)
        scalar = config.query_pre_attn_scalar
        cfg["query_pre_attn_scalar"] = int(scalar) if isinstance(scalar, float) and scalar.is_integer() else scalar
        cfg["final_logit_softcapping"] = config.final_logit_softcapping
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = config.attn_logit_softcapping
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = config.rope_local_base_freq
    if arch == "qwen3_moe":
        cfg.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob)
    if arch == "mixtral":  # Mixtral's experts are intermediate_size wide (config_from_hf reads them so)
        cfg.update(num_local_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size)
    for key in ("decoder_sparse_step", "mlp_only_layers"):
        if key in config.extra:
            cfg[key] = config.extra[key]
    return cfg


def _hf_architecture(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        archs = [_HF_ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in _HF_ARCHITECTURES]
        model_type = archs[0] if archs else cfg.get("architectures")
    model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type/architectures {model_type!r} in config.json; "
            f"tokenloom supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, local rope_theta) from either the transformers v4 or the v5
    (`rope_parameters`, per layer type for Gemma 3) layout."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_theta = cfg.get("rope_local_base_freq")
    if FULL in params or SLIDING in params:  # v5 Gemma 3: one dict per layer type
        local = params.get(SLIDING) or {}
        local_theta = local.get("rope_theta", local_theta)
        params = dict(params.get(FULL) or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)
    if "type" in params:  # pre-4.45 spelling
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None, local_theta
    if params.get("rope_type") in ("longrope", "su"):
        params.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return theta, params, local_theta


def _hf_sliding_window(cfg: dict[str, Any], arch: str) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types). Qwen2/Qwen3 configs carry a sliding_window that only counts
    when use_sliding_window is true; the others use theirs whenever it is set."""
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    if window == 0:  # vLLM: some checkpoints say 0 for "no sliding window"
        window = None
    layer_types = cfg.get("layer_types")
    if window is None:
        return None, None
    if layer_types is not None:
        unknown = set(layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"config.json layer_types has unknown entries {sorted(unknown)}")
        if SLIDING not in layer_types:
            return None, None
    elif arch in ("qwen2", "qwen3", "qwen3_moe"):  # v4 configs: layers from max_window_layers on slide
        first = int(cfg.get("max_window_layers") or 0)
        layer_types = [SLIDING if i >= first else FULL for i in range(cfg["num_hidden_layers"])]
        if SLIDING not in layer_types:
            return None, None
    elif arch == "gemma2":  # v4 configs: every other layer, starting with a sliding one
        layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(cfg["num_hidden_layers"])]
    elif arch == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(cfg["num_hidden_layers"])]
    return int(window), list(layer_types) if layer_types is not None else None
