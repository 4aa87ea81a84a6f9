"""The network's building blocks, shared by every family (vLLM's `model_executor/layers/` beside
`models/`): the step context every layer reads, the RMSNorm whose output is the next linear's input,
the attention block (qkv -> attention backend -> o), the gated MLP and the pre-norm decoder layer.

They carry Llama's names because Llama's layout is the one every family starts from (vLLM's Qwen2
and Mistral reuse LlamaMLP too). A family is a file in tokenloom/model/models/ that subclasses what
differs, through the decoder layer's hooks (`make_attention`, `make_mlp`, `attention_spec`,
`norm_weight_offset`), and an entry in tokenloom/model/models/registry.py.

What varies across dtypes and quantizations lives in two seams, not here: each linear's method
(tokenloom/model/linear.py, quant.py, gguf_method.py) and the attention backend
(tokenloom/model/attention_backends.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.model.attention import AttentionLayerSpec, AttentionMetadata, KVCache
from tokenloom.model.attention_backends import AttentionBackend
from tokenloom.model.config import ModelConfig
from tokenloom.model.linear import LinearBase, LinearMethodBase, PendingOutput
from tokenloom.model.weight_reader import WeightReader

Hidden = torch.Tensor | PendingOutput  # a linear's output, maybe not yet finished (see linear.py)


@dataclass
class StepContext:
    """What every layer of one forward shares."""

    positions: torch.Tensor  # [T]
    rope_tables: Any  # the attention backend's (see AttentionBackend.rope_tables)
    attn_metadata: AttentionMetadata
    attn_backend: AttentionBackend
    local_rope_tables: Any = None  # Gemma 3's sliding layers' rope (their own base), else None
    lora: Any = None  # the punica wrapper when a row of the step runs a LoRA adapter (tokenloom/lora/)


class RMSNorm:
    """RMSNorm whose output is the next linear's input: the consuming linear's method runs it (a
    fused kernel that also quantizes, for int8), optionally adding a sublayer's output into the
    residual stream first."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, hidden: Hidden | None, residual: torch.Tensor, method: LinearMethodBase) -> Any:
        """hidden None: norm(residual); else residual += hidden (in place), then norm(residual)."""
        if hidden is None:
            return method.rms_norm_input(residual, self.weight, self.eps)
        return method.add_rms_norm_input(hidden, residual, self.weight, self.eps)


class LlamaAttention:
    """qkv projection -> attention backend (rotary, KV write, paged attention) -> o projection.
    `spec`: this layer's scale / sliding window / soft-capping; `local_rope`: the layer rotates with
    the model's local rope tables (Gemma 3's sliding layers)."""

    spec = AttentionLayerSpec()
    local_rope = False

    def __init__(self, get: WeightReader, prefix: str, method: LinearMethodBase) -> None:
        names = [prefix + n for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = get.linear(names, method, prefix + "qkv_proj")  # [(Hq + 2 Hkv) * D, H]
        self.o_proj = get.linear([prefix + "o_proj"], method, prefix + "o_proj")

    def __call__(self, x: Any, ctx: StepContext, kv_cache: KVCache | None,
                 last_layer: bool) -> tuple[Hidden | None, torch.Tensor | None]:
        """x in qkv_proj's input format -> (o_proj's output, rows: see AttentionBackend.forward);
        output None when no row goes on."""
        qkv = self.qkv_proj.apply_input(x)
        qkv = self.qk_norm(qkv if isinstance(qkv, torch.Tensor) else qkv.dense())
        rope = ctx.local_rope_tables if self.local_rope and ctx.local_rope_tables is not None else ctx.rope_tables
        o, rows = ctx.attn_backend.forward(qkv, ctx.positions, rope, kv_cache, ctx.attn_metadata, last_layer,
                                           self.spec)
        if rows is not None and rows.numel() == 0:
            return None, rows
        if rows is not None and ctx.lora is not None:
            ctx.lora.narrow(rows)  # o_proj and the MLP run the output rows only from here on
        return self.o_proj.apply_input(self.o_proj.quant_method.quantize_input(o)), rows

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Hook for families that normalise q and k per head before rotary (Qwen3, Gemma 3)."""
        return qkv


class LlamaMLP:
    """down(silu(gate) * up), gate and up fused into one GEMM."""

    def __init__(self, get: WeightReader, prefix: str, method: LinearMethodBase) -> None:
        names = [prefix + n for n in ("gate_proj", "up_proj")]
        self.gate_up_proj = get.linear(names, method, prefix + "gate_up_proj")  # [2 I, H]
        self.down_proj = get.linear([prefix + "down_proj"], method, prefix + "down_proj")

    def __call__(self, x: Any) -> Hidden:
        """x in gate_up_proj's input format -> down_proj's output."""
        gate_up = self.gate_up_proj.apply_input(x)
        return self.down_proj.apply_input(self.down_proj.quant_method.silu_and_mul_input(gate_up))


class LlamaDecoderLayer:
    """Pre-norm attention and MLP blocks around one residual stream (Llama, Qwen2: Qwen2 differs
    only by the q/k/v biases, which the weights carry)."""

    norm_weight_offset = 0.0  # added to the final norm's weight (Gemma's (1 + w) convention)
    # The int8 W8A8 path covers the family: SmoothQuant folds into the norms that feed qkv and gate/up
    # (a mixture-of-experts MLP has no gate/up linear).
    int8_supported = True
    # The family's ops that no compiled CPU kernel covers yet: they run as torch ops (logged at load).
    torch_ops: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 layer_idx: int = 0) -> None:
        self.input_layernorm = RMSNorm(get(prefix + "input_layernorm.weight"), config.rms_norm_eps)
        self.self_attn = self.make_attention(config, get, prefix + "self_attn.", method)
        self.post_attention_layernorm = RMSNorm(get(prefix + "post_attention_layernorm.weight"), config.rms_norm_eps)
        self.mlp = self.make_mlp(config, get, prefix + "mlp.", method, layer_idx)
        self.self_attn.spec = self.attention_spec(config, layer_idx)

    # Family hooks: a subclass replaces the attention, the MLP or the attention's spec.
    def make_attention(self, config: ModelConfig, get: WeightReader, prefix: str,
                       method: LinearMethodBase) -> LlamaAttention:
        return LlamaAttention(get, prefix, method)

    def make_mlp(self, config: ModelConfig, get: WeightReader, prefix: str, method: LinearMethodBase,
                 layer_idx: int) -> Any:
        return LlamaMLP(get, prefix, method)

    def attention_spec(self, config: ModelConfig, layer_idx: int) -> AttentionLayerSpec:
        return AttentionLayerSpec(window=config.layer_window(layer_idx))

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm whose output the MLP's gate/up read (SmoothQuant folds into its weight)."""
        return self.post_attention_layernorm

    @property
    def first_linear(self) -> LinearBase:
        """The linear that reads the residual stream's norm (whose input format the previous layer's
        last norm produces)."""
        return self.self_attn.qkv_proj

    def linears(self) -> dict[str, LinearBase]:
        return {"qkv_proj": self.self_attn.qkv_proj, "o_proj": self.self_attn.o_proj,
                "gate_up_proj": self.mlp.gate_up_proj, "down_proj": self.mlp.down_proj}

    def __call__(self, hidden: Hidden | None, residual: torch.Tensor, ctx: StepContext, kv_cache: KVCache | None,
                 last_layer: bool) -> tuple[Hidden | None, torch.Tensor]:
        """(previous layer's MLP output, or None for the first layer; the residual stream) ->
        (this layer's MLP output, the residual stream). The residual is updated in place; the last
        layer may narrow it to the output rows (and return None when there are none)."""
        qkv_proj = self.self_attn.qkv_proj
        x = self.input_layernorm(hidden, residual, qkv_proj.quant_method)
        attn_out, rows = self.self_attn(x, ctx, kv_cache, last_layer)
        if rows is not None:
            residual = residual.index_select(0, rows)
        if attn_out is None:
            return None, residual
        x = self.post_attention_layernorm(attn_out, residual, self.mlp.gate_up_proj.quant_method)
        return self.mlp(x), residual

