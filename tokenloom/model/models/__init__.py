"""Model families beyond Llama/Qwen2, each a small decoder-layer class on llama.py's one layer loop,
registered by `ModelConfig.architecture` (the HF model_type; GGUF architecture keys map onto it in
tokenloom/model/gguf_families.py). Mistral and Phi-3 need no class of their own: Mistral is Llama's layout
with a sliding window (AttentionLayerSpec), Phi-3's fused qkv / gate-up checkpoints are split at load
(tokenloom/model/hf.py) and re-fused by the Llama layer."""

from __future__ import annotations

from tokenloom.model.llama import DECODER_LAYERS, LlamaDecoderLayer
from tokenloom.model.models.gemma import Gemma2DecoderLayer, Gemma3DecoderLayer
from tokenloom.model.models.mixtral import MixtralDecoderLayer
from tokenloom.model.models.qwen3 import Qwen3DecoderLayer
from tokenloom.model.models.qwen3_moe import Qwen3MoeDecoderLayer

DECODER_LAYERS.update({
    "mistral": LlamaDecoderLayer,
    "phi3": LlamaDecoderLayer,
    "qwen3": Qwen3DecoderLayer,
    "qwen3_moe": Qwen3MoeDecoderLayer,
    "mixtral": MixtralDecoderLayer,
    "gemma2": Gemma2DecoderLayer,
    "gemma3": Gemma3DecoderLayer,
})
