"""Which decoder-layer class runs each family, imported on first use (vLLM's models/registry.py:
architecture -> (module, class), so that loading one family imports only its own file).

Keys are `ModelConfig.architecture` (the HF model_type; GGUF architecture keys map onto it in
tokenloom/model/gguf_families.py). Families that differ from Llama only by what their config or
weights carry need no file: Qwen2's q/k/v biases come with the weights, Mistral's sliding window is
an AttentionLayerSpec, Phi-3's fused qkv / gate-up checkpoints are split at load
(tokenloom/model/hf.py) and re-fused by the Llama layer.

This module imports nothing of the model room at import time: the model imports it, and the family
files import the blocks (tokenloom/model/layers.py), never the model, so nothing imports in a circle.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.model.layers import LlamaDecoderLayer

_LAYERS = "tokenloom.model.layers"
_FAMILIES = "tokenloom.model.models."

# architecture -> (module, decoder-layer class)
DECODER_LAYERS: dict[str, tuple[str, str]] = {
    "llama": (_LAYERS, "LlamaDecoderLayer"),
    "qwen2": (_LAYERS, "LlamaDecoderLayer"),
    "mistral": (_LAYERS, "LlamaDecoderLayer"),
    "phi3": (_LAYERS, "LlamaDecoderLayer"),
    "qwen3": (_FAMILIES + "qwen3", "Qwen3DecoderLayer"),
    "qwen3_moe": (_FAMILIES + "qwen3_moe", "Qwen3MoeDecoderLayer"),
    "mixtral": (_FAMILIES + "mixtral", "MixtralDecoderLayer"),
    "gemma2": (_FAMILIES + "gemma", "Gemma2DecoderLayer"),
    "gemma3": (_FAMILIES + "gemma", "Gemma3DecoderLayer"),
}


@cache
def decoder_layer_class(architecture: str) -> type[LlamaDecoderLayer]:
    """The decoder-layer class of a family; its module is imported here, the first time it is asked for."""
    if architecture not in DECODER_LAYERS:
        raise ValueError(f"no decoder layer registered for architecture {architecture!r}; "
                         f"known: {', '.join(sorted(DECODER_LAYERS))}")
    module, name = DECODER_LAYERS[architecture]
    return getattr(importlib.import_module(module), name)
