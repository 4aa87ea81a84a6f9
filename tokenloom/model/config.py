"""ModelConfig: the shape of a Llama-family network, read from GGUF metadata or a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Each has a decoder layer in tokenloom/model/models/registry.py (tests/test_model_registry.py checks).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3")
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "model"
    # Sliding-window attention: a query at position p sees keys p - sliding_window + 1 .. p on the
    # layers whose layer_types entry is "sliding_attention" (HF's convention; None: every layer is
    # windowed when sliding_window is set, as Mistral's config says).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh" (Gemma)
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), tanh soft-capping
    # of attention scores and final logits, and the local (sliding) layers' rope base (Gemma 3).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None
    # Mixture of experts (qwen3_moe; mixtral: every layer, renormalised top-k, experts of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # The longest context the engine may run when it is shorter than max_position_embeddings: vLLM's derived
    # max_model_len under disable_sliding_window, which caps it at the window (tokenloom/model/hf_overrides.py).
    # None: max_position_embeddings. (The rotary tables still cover max_position_embeddings.)
    max_model_len_cap: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; tokenloom runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def context_length(self) -> int:
        """The longest prompt + output the model runs: max_position_embeddings, or less under max_model_len_cap."""
        if self.max_model_len_cap is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.max_model_len_cap)

    @property
    def context_length_key(self) -> str:
        """Which config value context_length comes from, for messages (vLLM's max_len_key)."""
        return "max_position_embeddings" if self.context_length == self.max_position_embeddings else "sliding_window"

    def is_sliding_layer(self, i: int) -> bool:
        """Whether layer i is one of the model's sliding-window layers by its type, whether or not its window is
        in force (Gemma 3 rotates those layers with their local base either way, as vLLM's Gemma 3 does under
        disable_sliding_window)."""
        if self.layer_types is not None:
            return self.layer_types[i] == SLIDING
        return self.sliding_window is not None

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window in tokens, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE: layer i is sparse on every decoder_sparse_step-th layer not in mlp_only_layers."""
        sparse_step = int(self.extra.get("decoder_sparse_step", 1))
        return (self.num_experts > 0 and i not in self.extra.get("mlp_only_layers", [])
                and (i + 1) % sparse_step == 0)

    @property
    def sliding_windows(self) -> list[int | None]:
        return [self.layer_window(i) for i in range(self.num_hidden_layers)]
