"""Llama / Qwen2 decoder over one flattened batch of exactly the scheduled tokens (no padding).

Weights come in with Hugging Face names and are rearranged once at load for speed: q/k/v fused
into one matrix (one GEMM instead of three), gate/up fused likewise, everything cast to the run
dtype and moved to the device. bf16 GEMMs on CPU go to oneDNN through plain F.linear.

With the compiled CPU kernels (`kernels`, see tokenloom/model/kernels.py) a layer is four GEMMs
plus five fused calls: rotary + KV-cache write, paged attention over the whole step, residual add +
RMSNorm (twice) and SiLU-and-mul. Without them (CUDA, or no compiler) the same arithmetic runs as
plain torch ops. With `quantization="int8"` the four GEMMs take int8 operands (tokenloom/model/quant.py)
and the fused calls around them quantize their outputs and scale the GEMMs' int32 results back.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenloom.model.attention import AttentionMetadata, KVCache, paged_attention, paged_attention_fused
from tokenloom.model.config import ModelConfig
from tokenloom.model.gemm_rows import packed_rows
from tokenloom.model.quant import Int8Linear, check_quantization, smoothing_scales

logger = logging.getLogger(__name__)

# The rope table grows on demand up to max_position_embeddings; this is its first size.
_INITIAL_ROPE_POSITIONS = 4096


@dataclass
class Linear:
    """y = x @ weight.T + bias. `packed`: the weight reordered once into oneDNN's blocked layout
    (CPU bf16, see `pack_linear`), which skips the per-call reorder: 5-30 % faster GEMMs here."""

    weight: torch.Tensor | None  # [out, in]; dropped once packed (the packed copy replaces it)
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0]
        rows = packed_rows(m)
        if rows == m:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        padded = x.new_zeros((rows, x.shape[1]))
        padded[:m].copy_(x)
        return torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:m]


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear | Int8Linear  # [(Hq + 2 Hkv) * D, H]
    o: Linear | Int8Linear
    post_norm: torch.Tensor
    gate_up: Linear | Int8Linear  # [2 I, H]
    down: Linear | Int8Linear

    _LINEARS = ("qkv", "o", "gate_up", "down")

    def quantize_int8(self, act_absmax: dict[str, torch.Tensor] | None, num_kv_heads: int, head_dim: int) -> None:
        """Replace the four linears by Int8Linear; with `act_absmax` (each linear's input channel
        maxima from a calibration run) SmoothQuant-smooth them first (see tokenloom/model/quant.py)."""
        dtype = self.input_norm.dtype
        w, b = self._float_weights()
        if act_absmax is not None:
            self._smooth(w, b, act_absmax, num_kv_heads, head_dim)
        for name in self._LINEARS:
            setattr(self, name, Int8Linear.from_weight(w[name], b[name], dtype))

    def smooth(self, act_absmax: dict[str, torch.Tensor], num_kv_heads: int, head_dim: int) -> None:
        """SmoothQuant's rescaling alone, the layers staying floating point (the network computes the
        same function up to rounding: what the tests check)."""
        dtype = self.input_norm.dtype
        w, b = self._float_weights()
        self._smooth(w, b, act_absmax, num_kv_heads, head_dim)
        for name in self._LINEARS:
            bias = None if b[name] is None else b[name].to(dtype)
            setattr(self, name, Linear(w[name].to(dtype).contiguous(), bias))

    def _float_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
        lins = {name: getattr(self, name) for name in self._LINEARS}
        if not all(isinstance(lin, Linear) and lin.weight is not None for lin in lins.values()):
            raise RuntimeError("the layer's linears are already quantized or pre-packed")
        w = {name: lin.weight.float() for name, lin in lins.items()}  # type: ignore[union-attr]
        b = {name: None if lin.bias is None else lin.bias.float() for name, lin in lins.items()}
        return w, b

    def _smooth(self, w: dict[str, torch.Tensor], b: dict[str, torch.Tensor | None],
                act_absmax: dict[str, torch.Tensor], num_kv_heads: int, head_dim: int) -> None:
        """Rescale fp32 copies `w`, `b` (in place) and the norm weights; see quantize_int8."""
        dtype = self.input_norm.dtype
        # qkv and gate/up read RMSNorm outputs: the norm weight takes the division.
        s = smoothing_scales(act_absmax["qkv"], [w["qkv"]])
        self.input_norm = (self.input_norm.float() / s).to(dtype)
        w["qkv"] = w["qkv"] * s
        s = smoothing_scales(act_absmax["gate_up"], [w["gate_up"]])
        self.post_norm = (self.post_norm.float() / s).to(dtype)
        w["gate_up"] = w["gate_up"] * s
        # down reads silu(gate) * up: the up rows take it.
        s = smoothing_scales(act_absmax["down"], [w["down"]])
        inter = s.numel()
        w["gate_up"][inter:] /= s[:, None]
        if b["gate_up"] is not None:
            b["gate_up"][inter:] /= s
        w["down"] = w["down"] * s
        # o reads attention outputs, weighted sums of v: the v rows take it. The q heads of a
        # GQA group share their v head, so they share one factor (the group's largest).
        s = smoothing_scales(act_absmax["o"], [w["o"]])
        group = s.numel() // (num_kv_heads * head_dim)
        s_kv = s.view(num_kv_heads, group, head_dim).amax(dim=1)
        v_rows = slice(w["qkv"].shape[0] - num_kv_heads * head_dim, None)
        w["qkv"][v_rows] /= s_kv.reshape(-1, 1)
        if b["qkv"] is not None:
            b["qkv"][v_rows] /= s_kv.reshape(-1)
        w["o"] = w["o"] * s_kv[:, None, :].expand(-1, group, -1).reshape(-1)


def packing_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN weight pre-packing: CPU bf16 only (fp32 GEMMs go to MKL, which packs nothing faster),
    and off with TOKENLOOM_PACKED_LINEAR=0."""
    if os.environ.get("TOKENLOOM_PACKED_LINEAR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


def pack_linear(lin: Linear, batch_hint: int = 128, check: bool = False) -> bool:
    """Pre-pack `lin` in place (a private torch API: any failure, or with `check` a result that
    differs from F.linear, leaves it unpacked). True if packed."""
    assert lin.weight is not None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight, batch_hint)
        if check:
            probe = torch.randn(3, lin.weight.shape[1], generator=torch.Generator().manual_seed(0))
            probe = probe.to(lin.weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, lin.bias, "none", [], "").float()
            want = F.linear(probe, lin.weight, lin.bias).float()
            tol = 1e-2 * want.abs().max().item()
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2, atol=tol):
                return False
    except (RuntimeError, AttributeError, TypeError):
        return False
    lin.packed = packed
    return True


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (fp32, [head_dim / 2]) as HF computes them, with rope_scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (same formula as transformers' rope utils)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style (rotate_half) rotary embedding from precomputed cos/sin tables."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.max_positions = config.max_position_embeddings
        self.device, self.dtype = device, dtype
        self.cos = self.sin = torch.empty(0)
        self._build(min(self.max_positions, _INITIAL_ROPE_POSITIONS))

    def _build(self, num_positions: int) -> None:
        # fp32 angles, cast once to the run dtype: what HF does per forward.
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        self.cos = freqs.cos().to(self.device, self.dtype)
        self.sin = freqs.sin().to(self.device, self.dtype)

    def full_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [P, D / 2] (P > max_position), grown if needed."""
        if max_position >= self.cos.shape[0]:
            self._build(max(max_position + 1, 2 * self.cos.shape[0]))
        return self.cos, self.sin

    def tables(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, D / 2]: computed once per step, shared by all layers."""
        cos, sin = self.full_tables(max_position)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] -> rotated copy. Same arithmetic as HF's q*cos + rotate_half(q)*sin."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm. torch's kernel accumulates in fp32 and rounds once, so in bf16 it is slightly more
    accurate than HF's (which rounds the normalized x before scaling), and faster."""
    return F.rms_norm(x, weight.shape, weight, eps)


class LlamaModel:
    """The network. `forward` maps the step's tokens to final hidden states; `compute_logits`
    projects only the rows that sample."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernels: Any = None,
        quantization: str | None = None,
        calibration_token_ids: list[int] | None = None,
        calibration_threads: int | None = None,
    ) -> None:
        """`kernels`: the compiled CPU kernels module (tokenloom.model.kernels.cpu_kernels()), or None.
        `quantization`: None, or "int8" for W8A8 layers (tokenloom/model/quant.py; the LM head stays
        in `dtype`). `calibration_token_ids`: text whose activations set int8's smoothing factors
        (without it the int8 layers are not smoothed); `calibration_threads`: torch threads for that
        forward (compute-bound, unlike the rest of loading; default: the current setting)."""
        check_quantization(quantization, torch.device(device))
        self.config = config
        self.kernels = kernels if torch.device(device).type == "cpu" else None
        # The KV cache holds the kernels' packed bf16 layout (set by the runner, which allocates it).
        self.kv_packed = False
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_q_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        get = _WeightReader(weights, self.device, dtype)
        self.embed_tokens = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = Linear(get("lm_head.weight"))
        else:
            self.lm_head = Linear(self.embed_tokens)
        self.layers = [self._load_layer(get, i) for i in range(config.num_hidden_layers)]
        self.rope = RotaryEmbedding(config, self.device, dtype)
        self.quantization = quantization
        if quantization == "int8":
            stats = None
            if calibration_token_ids:
                previous = torch.get_num_threads()
                torch.set_num_threads(calibration_threads or previous)
                try:
                    stats = self._activation_absmax(calibration_token_ids)
                finally:
                    torch.set_num_threads(previous)
            for i, layer in enumerate(self.layers):
                layer.quantize_int8(stats[i] if stats else None, self.num_kv_heads, self.head_dim)
        self.packed_linear = packing_enabled(self.device, dtype) and self._pack_all()

    def linears(self) -> list[Linear]:
        """The floating-point linears (all of them, or with int8 layers just the LM head)."""
        lins = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [lin for lin in lins if isinstance(lin, Linear)] + [self.lm_head]

    def _pack_all(self) -> bool:
        """Pre-pack every linear weight, or none (a partial failure leaves all on F.linear)."""
        lins = self.linears()
        # The first one is checked against F.linear: the API is private, a torch upgrade could change it.
        if all(pack_linear(lin, check=i == 0) for i, lin in enumerate(lins)):
            for lin in lins:
                lin.weight = None  # the packed copy replaces it (the tied lm_head's lives on as embed_tokens)
            return True
        for lin in lins:
            lin.packed = None
        logger.warning("oneDNN weight pre-packing is unavailable here; using F.linear")
        return False

    def _activation_absmax(self, token_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """Per layer, each linear's largest |input| per channel (fp32 [K]) over a dense causal
        forward of `token_ids` (no KV cache: calibration runs before there is one)."""
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        t = ids.numel()
        cos, sin = self.rope.tables(torch.arange(t, device=self.device), t - 1)
        stats: list[dict[str, torch.Tensor]] = []
        with torch.inference_mode():
            h = F.embedding(ids, self.embed_tokens)
            for layer in self.layers:
                seen: dict[str, torch.Tensor] = {}

                def linear(name: str, x: torch.Tensor, layer: _Layer = layer,
                           seen: dict[str, torch.Tensor] = seen) -> torch.Tensor:
                    seen[name] = x.float().abs().amax(dim=0)
                    return getattr(layer, name)(x)

                qkv = linear("qkv", rms_norm(h, layer.input_norm, self.eps))
                qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
                # 4-D [1, heads, T, D]: with 3-D inputs torch's CPU SDPA takes its slow math path.
                q, k = qk[:, :hq].transpose(0, 1)[None], qk[:, hq:].transpose(0, 1)[None]
                v = qkv[:, (hq + hkv) * d :].view(t, hkv, d).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                h = h + linear("o", o[0].transpose(0, 1).reshape(t, hq * d))
                gate, up = linear("gate_up", rms_norm(h, layer.post_norm, self.eps)).chunk(2, dim=-1)
                h = h + linear("down", F.silu(gate) * up)
                stats.append(seen)
        return stats

    @staticmethod
    def _load_layer(get: _WeightReader, i: int) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return _Layer(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=Linear(
                get.cat([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"]),
                get.cat_optional([attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]),
            ),
            o=Linear(get(attn + "o_proj.weight"), get.optional(attn + "o_proj.bias")),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=Linear(
                get.cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
                get.cat_optional([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
            ),
            down=Linear(get(mlp + "down_proj.weight"), get.optional(mlp + "down_proj.bias")),
        )

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.shape[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
        max_position: int | None = None,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-norm hidden states [T, H]. Writes this step's K/V."""
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        if self.kernels is not None and attn_metadata.kernel is not None:
            if self.quantization == "int8":
                return self._forward_fused_int8(input_ids, positions, attn_metadata, kv_caches, max_position)
            return self._forward_fused(input_ids, positions, attn_metadata, kv_caches, max_position)
        cos, sin = self.rope.tables(positions, max_position)
        h = F.embedding(input_ids, self.embed_tokens)  # a fresh tensor: the residual adds go in place
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_norm, self.eps)
            h += self._attention(layer, x, cos, sin, attn_metadata, kv_cache)
            h += self._mlp(layer, rms_norm(h, layer.post_norm, self.eps))
        return rms_norm(h, self.final_norm, self.eps)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        max_position: int,
    ) -> torch.Tensor:
        """The same network through the compiled CPU kernels (see the module docstring)."""
        k = self.kernels
        assert meta.kernel is not None
        cos, sin = self.rope.full_tables(max_position)
        hq, eps = self.num_q_heads, self.eps
        h = F.embedding(input_ids, self.embed_tokens)  # the residual stream, updated in place
        x = torch.empty_like(h)
        k.rms_norm(x, h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv = layer.qkv(x)
            k.rotary_and_cache(qkv, positions, cos, sin, hq, kv_cache[0], kv_cache[1], meta.slot_mapping,
                               self.kv_packed)
            attn_meta = meta.kernel
            if i == last and meta.output_rows is not None:
                if meta.output_rows.numel() == 0:
                    return h[:0]
                qkv, h, attn_meta = _output_rows(meta, qkv, h)
            o = paged_attention_fused(k, qkv, hq, kv_cache, attn_meta, self.kv_packed)
            x = layer.o(o)
            k.fused_add_rms_norm(x, h, layer.post_norm, eps)  # h += attention; x = norm(h)
            gate_up = layer.gate_up(x)
            act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
            k.silu_and_mul(act, gate_up)
            x = layer.down(act)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            k.fused_add_rms_norm(x, h, next_norm, eps)  # h += mlp; x = next layer's input (or final) norm
        return x

    def _forward_fused_int8(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        max_position: int,
    ) -> torch.Tensor:
        """`_forward_fused` with int8 GEMMs: each GEMM's input arrives quantized from the kernel
        before it (norm or SiLU-and-mul) and its int32 output is scaled back inside the kernel after
        it, so activations cross memory as int8 rows."""
        k = self.kernels
        assert meta.kernel is not None
        cos, sin = self.rope.full_tables(max_position)
        hq, eps, dt = self.num_q_heads, self.eps, self.dtype
        h = F.embedding(input_ids, self.embed_tokens)  # the residual stream, updated in place
        t = h.shape[0]
        xq, xs = _quant_buffers(t, h.shape[1])
        k.rms_norm_quant(xq, xs, h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            qkv_lin, o_lin, gu_lin, down_lin = layer.qkv, layer.o, layer.gate_up, layer.down
            assert isinstance(qkv_lin, Int8Linear) and isinstance(o_lin, Int8Linear)
            assert isinstance(gu_lin, Int8Linear) and isinstance(down_lin, Int8Linear)
            acc = qkv_lin.int_mm(xq)
            qkv = torch.empty(acc.shape, dtype=dt)
            k.dequant(qkv, acc, xs, qkv_lin.scale, qkv_lin.bias)
            k.rotary_and_cache(qkv, positions, cos, sin, hq, kv_cache[0], kv_cache[1], meta.slot_mapping,
                               self.kv_packed)
            attn_meta = meta.kernel
            if i == last and meta.output_rows is not None:
                if meta.output_rows.numel() == 0:
                    return h[:0]
                qkv, h, attn_meta = _output_rows(meta, qkv, h)
                t = h.shape[0]
            o = paged_attention_fused(k, qkv, hq, kv_cache, attn_meta, self.kv_packed)
            oq, os_ = _quant_buffers(t, o.shape[1])
            k.quantize_rows(oq, os_, o)
            xq, xs = _quant_buffers(t, h.shape[1])
            k.dequant_add_rms_norm_quant(xq, xs, o_lin.int_mm(oq), os_, o_lin.scale, o_lin.bias, h,
                                         layer.post_norm, eps)  # h += attention; x = quant(norm(h))
            acc = gu_lin.int_mm(xq)
            aq, as_ = _quant_buffers(t, acc.shape[1] // 2)
            k.dequant_silu_mul_quant(aq, as_, acc, xs, gu_lin.scale, gu_lin.bias)
            acc = down_lin.int_mm(aq)
            if i < last:
                xq, xs = _quant_buffers(t, h.shape[1])
                k.dequant_add_rms_norm_quant(xq, xs, acc, as_, down_lin.scale, down_lin.bias, h,
                                             self.layers[i + 1].input_norm, eps)
            else:
                x = torch.empty_like(h)
                k.dequant(x, acc, as_, down_lin.scale, down_lin.bias)
                k.fused_add_rms_norm(x, h, self.final_norm, eps)  # h += mlp; x = final norm(h)
        return x

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = layer.qkv(x)
        # Rotate q and k together: one set of elementwise kernels for both.
        qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        o = paged_attention(qk[:, :hq], qk[:, hq:], v, kv_cache, meta)
        return layer.o(o)

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Hidden states of the sampling rows [S, H] -> logits [S, V] (fp32, or the run dtype)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits


def _output_rows(meta: AttentionMetadata, qkv: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The last layer: every row's K/V is written, then only the output rows go on (see
    AttentionMetadata): their qkv and residual rows, and the kernel metadata for them alone."""
    assert meta.output_rows is not None and meta.output_kernel is not None
    return qkv.index_select(0, meta.output_rows), h.index_select(0, meta.output_rows), meta.output_kernel


def _quant_buffers(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised int8 rows and their fp32 scales, for a kernel to fill."""
    return torch.empty((rows, cols), dtype=torch.int8), torch.empty(rows, dtype=torch.float32)


class _WeightReader:
    """Fetches HF-named weights, cast to the run dtype and moved to the device."""

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        self.weights, self.device, self.dtype = weights, device, dtype

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return self._convert(self.weights[name])

    def optional(self, name: str) -> torch.Tensor | None:
        return self(name) if name in self.weights else None

    def cat(self, names: list[str]) -> torch.Tensor:
        return self._convert(torch.cat([self._raw(n) for n in names], dim=0))

    def cat_optional(self, names: list[str]) -> torch.Tensor | None:
        present = [n in self.weights for n in names]
        if not any(present):
            return None
        if not all(present):
            # e.g. only some of q/k/v carry a bias: the others get zeros so the fused GEMM stays one.
            ref = next(self.weights[n] for n, p in zip(names, present) if p)
            parts = [
                self._raw(n) if p else self._zero_bias_like(n, ref) for n, p in zip(names, present)
            ]
            return self._convert(torch.cat(parts))
        return self._convert(torch.cat([self._raw(n) for n in names]))

    def _zero_bias_like(self, bias_name: str, ref: torch.Tensor) -> torch.Tensor:
        out_features = self._raw(bias_name.removesuffix(".bias") + ".weight").shape[0]
        return torch.zeros(out_features, dtype=ref.dtype)

    def _raw(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"weight {name!r} missing from the checkpoint")
        return self.weights[name]

    def _convert(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=self.device, dtype=self.dtype).contiguous()
