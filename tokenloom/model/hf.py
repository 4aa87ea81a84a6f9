"""Hugging Face model directories: config.json → ModelConfig, *.safetensors → weights in HF naming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tokenloom.model.config import SUPPORTED_ARCHITECTURES, ModelConfig

_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config = config_from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _ignored_hf_tensor(name, config):
                    continue
                if name in weights:
                    raise ValueError(f"{path}: tensor {name!r} appears in more than one safetensors file")
                weights[name] = f.get_tensor(name).to(dtype)
    return config, weights


def _ignored_hf_tensor(name: str, config: ModelConfig) -> bool:
    # Older checkpoints saved rotary buffers; tied checkpoints sometimes store lm_head anyway.
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def config_from_hf(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """Build a `ModelConfig` from a parsed Hugging Face config.json."""
    arch = _hf_architecture(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; tokenloom implements silu only")
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=true; tokenloom attends over the full context")
    heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = _hf_rope(cfg)
    eos, extra = cfg.get("eos_token_id"), {}
    if isinstance(eos, list):  # e.g. Llama 3 stops on several ids
        extra["eos_token_ids"] = eos
        eos = eos[0] if eos else None
    return ModelConfig(
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
        # Both LlamaConfig and Qwen2Config default to untied.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and its config has no flag for it.
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        name=name,
        extra=extra,
    )


def _hf_architecture(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type is None:
        archs = [_HF_ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in _HF_ARCHITECTURES]
        model_type = archs[0] if archs else cfg.get("architectures")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type/architectures {model_type!r} in config.json; "
            f"tokenloom supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the transformers v4 or the v5 (`rope_parameters`) layout."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params:  # pre-4.45 spelling
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params
