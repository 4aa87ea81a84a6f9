"""SmoothQuant for the int8 layers: calibration statistics and the folds, applied once at load.

Per-row activation scales are at the mercy of outlier channels (see tokenloom/model/quant.py).
SmoothQuant divides each input channel j of a linear by s_j = max|X_j|^alpha / max|W_j|^(1-alpha)
and multiplies the weight's column j by it, which leaves the product unchanged; the division is
folded into whatever produces X, so it costs nothing at run time.

Calibration runs the model's own layer loop over tokenloom/data/calibration.txt with the dense
causal attention backend (no KV cache) and an observing linear method that records each linear's
largest |input| per channel, before the weights are quantized or pre-packed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.attention_backends import DenseCausalAttentionBackend
from tokenloom.model.linear import LinearBase, UnquantizedLinearMethod
from tokenloom.model.quant import get_linear_method

if TYPE_CHECKING:
    from tokenloom.model.decoder_model import DecoderModel
    from tokenloom.model.layers import LlamaDecoderLayer

SMOOTHING_ALPHA = 0.6  # of 0.5 / 0.6 / 0.7 the best on the quality benchmark (docs/performance.md)


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant factors per input channel, fp32 [K]: s = max|X|^alpha / max|W|^(1 - alpha), the
    weights' max taken over every matrix that reads X (e.g. q, k and v)."""
    wmax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


class _AbsmaxObserver(UnquantizedLinearMethod):
    """The plain torch path (no kernels, weights as loaded) that records, per linear, the largest
    |input| per channel (fp32 [K])."""

    def __init__(self) -> None:
        super().__init__(kernels=None)
        self.seen: dict[int, torch.Tensor] = {}

    def apply_input(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        self.seen[id(layer)] = x.float().abs().amax(dim=0)
        return super().apply_input(layer, x)


def activation_absmax(model: DecoderModel, token_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, each linear's largest |input| per channel (name -> fp32 [K]) over a dense
    causal forward of `token_ids` (no KV cache: calibration runs before there is one)."""
    observer = _AbsmaxObserver()
    saved_methods = [(lin, lin.quant_method) for layer in model.layers for lin in layer.linears().values()]
    saved_backend = model.attn_backend
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    t = ids.numel()
    try:
        for lin, _ in saved_methods:
            lin.quant_method = observer
        model.attn_backend = DenseCausalAttentionBackend(model.num_q_heads, model.num_kv_heads, model.head_dim,
                                                         model.device)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=model.device))
        with torch.inference_mode():
            model.forward(ids, torch.arange(t, device=model.device), meta, [None] * len(model.layers), t - 1)
    finally:
        for lin, method in saved_methods:
            lin.quant_method = method
        model.attn_backend = saved_backend
    return [{name: observer.seen[id(lin)] for name, lin in layer.linears().items()} for layer in model.layers]


def _float_weights(layer: LlamaDecoderLayer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    lins = layer.linears()
    if not all(isinstance(lin.quant_method, UnquantizedLinearMethod) and lin.weight is not None
               for lin in lins.values()):
        raise RuntimeError("the layer's linears are already quantized or pre-packed")
    w = {name: lin.weight.float() for name, lin in lins.items()}  # type: ignore[union-attr]
    b = {name: None if lin.bias is None else lin.bias.float() for name, lin in lins.items()}
    return w, b


def _fold(layer: LlamaDecoderLayer, w: dict[str, torch.Tensor], b: dict[str, torch.Tensor | None],
          act_absmax: dict[str, torch.Tensor], num_kv_heads: int, head_dim: int) -> None:
    """Rescale fp32 copies `w`, `b` (in place) and the layer's norm weights (Llama's wiring, where
    the MLP reads `layer.mlp_input_norm`: post_attention_layernorm, Gemma's pre_feedforward_layernorm;
    a family with other producers of a linear's input needs its own fold)."""
    dtype = layer.input_layernorm.weight.dtype
    lins = layer.linears()
    # qkv and gate/up read RMSNorm outputs: the norm weight takes the division.
    s = smoothing_scales(act_absmax["qkv_proj"], [w["qkv_proj"]])
    lins["qkv_proj"].lora_scales = (s, None)
    layer.input_layernorm.weight = (layer.input_layernorm.weight.float() / s).to(dtype)
    w["qkv_proj"] = w["qkv_proj"] * s
    s = smoothing_scales(act_absmax["gate_up_proj"], [w["gate_up_proj"]])
    norm = layer.mlp_input_norm
    norm.weight = (norm.weight.float() / s).to(dtype)
    w["gate_up_proj"] = w["gate_up_proj"] * s
    s_gate_up = s
    # down reads silu(gate) * up: the up rows take it.
    s = smoothing_scales(act_absmax["down_proj"], [w["down_proj"]])
    inter = s.numel()
    w["gate_up_proj"][inter:] /= s[:, None]
    bias = b["gate_up_proj"]
    if bias is not None:
        bias[inter:] /= s
    w["down_proj"] = w["down_proj"] * s
    lins["down_proj"].lora_scales = (s, None)
    lins["gate_up_proj"].lora_scales = (s_gate_up, torch.cat([torch.ones_like(s), s]))
    # o reads attention outputs, weighted sums of v: the v rows take it. The q heads of a
    # GQA group share their v head, so they share one factor (the group's largest).
    s = smoothing_scales(act_absmax["o_proj"], [w["o_proj"]])
    group = s.numel() // (num_kv_heads * head_dim)
    s_kv = s.view(num_kv_heads, group, head_dim).amax(dim=1)
    v_rows = slice(w["qkv_proj"].shape[0] - num_kv_heads * head_dim, None)
    w["qkv_proj"][v_rows] /= s_kv.reshape(-1, 1)
    bias = b["qkv_proj"]
    if bias is not None:
        bias[v_rows] /= s_kv.reshape(-1)
    w["o_proj"] = w["o_proj"] * s_kv[:, None, :].expand(-1, group, -1).reshape(-1)
    # A LoRA adapter on these linears sees the smoothed activations and produces into the smoothed
    # outputs: (input channel factors, output row divisors) let it undo both (tokenloom/lora/models.py).
    out_div = torch.ones(w["qkv_proj"].shape[0])
    out_div[v_rows] = s_kv.reshape(-1)
    lins["qkv_proj"].lora_scales = (lins["qkv_proj"].lora_scales[0], out_div)
    lins["o_proj"].lora_scales = (s_kv[:, None, :].expand(-1, group, -1).reshape(-1), None)


def smooth_layer(layer: LlamaDecoderLayer, act_absmax: dict[str, torch.Tensor], num_kv_heads: int,
                 head_dim: int) -> None:
    """SmoothQuant's rescaling alone, the layer staying floating point (the network computes the
    same function up to rounding: what the tests check)."""
    dtype = layer.input_layernorm.weight.dtype
    w, b = _float_weights(layer)
    _fold(layer, w, b, act_absmax, num_kv_heads, head_dim)
    for name, lin in layer.linears().items():
        bias = b[name]
        lin.weight = w[name].to(dtype).contiguous()
        lin.bias = None if bias is None else bias.to(dtype)


def quantize_layer(layer: LlamaDecoderLayer, method: Any, act_absmax: dict[str, torch.Tensor] | None,
                   num_kv_heads: int, head_dim: int) -> None:
    """Switch the layer's linears to `method`, quantizing from fp32 weights; with `act_absmax`
    SmoothQuant-smoothed first."""
    w, b = _float_weights(layer)
    if act_absmax is not None:
        _fold(layer, w, b, act_absmax, num_kv_heads, head_dim)
    for name, lin in layer.linears().items():
        lin.weight, lin.bias = w[name], b[name]
        lin.set_quant_method(method)


def quantize_model(model: DecoderModel, quantization: str, calibration_token_ids: list[int] | None,
                   calibration_threads: int | None = None) -> None:
    """The decoder layers' linears to `quantization`'s method (one object shared by all), smoothed
    with the activations of `calibration_token_ids` when given (`calibration_threads`: torch threads
    for that compute-bound forward)."""
    stats = None
    if calibration_token_ids:
        previous = torch.get_num_threads()
        torch.set_num_threads(calibration_threads or previous)
        try:
            stats = activation_absmax(model, calibration_token_ids)
        finally:
            torch.set_num_threads(previous)
    method = get_linear_method(quantization, model.kernels, int8_gemm=model.plan.int8_gemm)
    for i, layer in enumerate(model.layers):
        quantize_layer(layer, method, stats[i] if stats else None, model.num_kv_heads, model.head_dim)
