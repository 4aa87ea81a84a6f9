"""The fused decode step: a batch-1 (and small-batch) decode step in one compiled call, for GGUF
models and for unquantized float32 / bf16 models whose layer weights stay plain (the execution
plan chooses it: tokenloom/model/execution_plan.py).

The compiled decoder (the class `FusedDecoder` of csrc/fused_decode.cpp, built into one extension with
the GGUF dot products of csrc/gguf_kernels.cpp: tokenloom/model/gguf_kernels.py) holds the whole stack:
every layer's norms and linears (q/k/v and gate/up each one matrix where their GGML types agree;
the same tensors the model's GGUFLinear or plain linears hold, not copies: GGUF blocks, float32
(GGML type F32) or bf16 (BF16) matrices) and the KV caches; a decode step is one `step()` call,
so no Python runs per op or per layer. `build_decoder` assembles it (the model does, from its
layers); `decoder_from_weights` from `load_gguf_quantized`'s weights directly.

Steps it takes: decodes only (one new token per sequence), up to the plan's `fused_decode_rows`
sequences, plain KV layout; anything else (prefill chunks, mixed steps, bigger batches) runs per op.
Batch-invariant (VLLM_BATCH_INVARIANT, `every_row`): every step, whatever its rows. A prefill chunk's
or a verification's rows are then rows of their own, each a one-token query at its position over its
sequence's cache (the decoder writes every row's K/V before any row attends), so each row meets the
same arithmetic in every step: its norms, attention and activations are its own, and the linears' tile
kernels sum each row alike at every row count (docs/reproducibility.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf_weights import GGUFLinear, GGUFWeight

DENSE = 0  # part type of a float32 matrix (GGML_TYPE_F32)
BF16 = 30  # part type of a bfloat16 matrix (GGML_TYPE_BF16)

PartSpec = tuple[torch.Tensor, int, "torch.Tensor | None", bool]


def dense_part(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A float weight as a decoder part: bf16 stays bf16 (BF16), anything else float32 (DENSE);
    already-contiguous tensors of those dtypes are shared, not copied."""
    if weight.dtype == torch.bfloat16:
        return weight.contiguous(), BF16
    return weight.float().contiguous(), DENSE


def linear_parts(gguf: GGUFLinear | None, weight: torch.Tensor | None, bias: torch.Tensor | None) -> list[PartSpec]:
    """The decoder's (data, type, bias, packed) parts of one linear: a GGUFLinear's parts (shared,
    not copied), or a float weight."""
    if gguf is None:
        assert weight is not None
        data, kind = dense_part(weight)
        return [(data, kind, None if bias is None else bias.float().contiguous(), False)]
    parts, col = [], 0
    for p in gguf.parts:
        n = p.shape[0]
        b = None if gguf.bias is None else gguf.bias[col : col + n].contiguous()
        parts.append((p.data, p.qtype, b, p.packed8))
        col += n
    return parts


@dataclass
class DecoderLayerSpec:
    attn_norm: torch.Tensor
    qkv: list[PartSpec]
    o: list[PartSpec]
    ffn_norm: torch.Tensor
    gate_up: list[PartSpec]
    down: list[PartSpec]


def build_decoder(kernels: Any, config: ModelConfig, embed: GGUFWeight | torch.Tensor, final_norm: torch.Tensor,
                  layers: list[DecoderLayerSpec]) -> Any:
    """The compiled fused decoder over these weights. KV caches come later (`set_kv_caches`), once the runner has
    allocated them."""
    if isinstance(embed, GGUFWeight):  # the file's rows, or the 8-row layout a tied LM head shares
        embed_data, embed_type, embed_packed = embed.data, embed.qtype, embed.packed8
    else:
        (embed_data, embed_type), embed_packed = dense_part(embed), False
    dec = kernels.FusedDecoder(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.intermediate_size, config.rms_norm_eps, embed_data, embed_type,
                              final_norm.float().contiguous(), embed_packed)
    for spec in layers:
        dec.add_layer(spec.attn_norm.float().contiguous(), spec.qkv, spec.o, spec.ffn_norm.float().contiguous(),
                      spec.gate_up, spec.down)
    return dec


def decoder_from_weights(kernels: Any, config: ModelConfig, weights: dict[str, Any]) -> Any:
    """build_decoder over `load_gguf_quantized`'s weights (HF names; GGUFWeight or float tensors)."""

    def parts(names: list[str], biases: list[str]) -> list[PartSpec]:
        ws = [weights[n] for n in names]
        bs = [weights.get(b) for b in biases]
        if all(isinstance(w, GGUFWeight) for w in ws):
            return linear_parts(GGUFLinear.from_weights(ws, bs, kernels), None, None)
        dense = [w.dequantize() if isinstance(w, GGUFWeight) else w for w in ws]
        if len({w.dtype for w in dense}) > 1 or dense[0].dtype != torch.bfloat16:  # bf16 stays bf16
            dense = [w.float() for w in dense]
        dense = torch.cat(dense)
        bias = None
        if any(b is not None for b in bs):
            bias = torch.cat([b.float() if b is not None else torch.zeros(w.shape[0]) for w, b in zip(ws, bs)])
        return linear_parts(None, dense, bias)

    specs = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        specs.append(DecoderLayerSpec(
            weights[p + "input_layernorm.weight"],
            parts([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                  [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            parts([a + "o_proj.weight"], [a + "o_proj.bias"]),
            weights[p + "post_attention_layernorm.weight"],
            parts([m + "gate_proj.weight", m + "up_proj.weight"], [m + "gate_proj.bias", m + "up_proj.bias"]),
            parts([m + "down_proj.weight"], [m + "down_proj.bias"]),
        ))
    return build_decoder(kernels, config, weights["model.embed_tokens.weight"], weights["model.norm.weight"], specs)


class FusedDecodeStep:
    """The model's fast path for small all-decode steps: binds the runner's KV caches to the
    decoder once and runs `step()` when the step qualifies (see `run`)."""

    def __init__(self, decoder: Any, hidden_size: int, dtype: torch.dtype, max_rows: int, *,
                 every_row: bool = False) -> None:
        self.decoder = decoder
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.every_row = every_row  # ExecutionPlan.batch_invariant: every step, any rows, no row cap
        # ExecutionPlan.fused_decode_rows (TOKENLOOM_FUSED_DECODE_ROWS)
        self.max_rows = sys.maxsize if every_row else max_rows
        self._bound: int | None = None  # data_ptr of the first K cache bound to the decoder

    def run_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list, rope: Any,
                 max_position: int) -> torch.Tensor | None:
        """`run` for the model's forward, from the kernel attention backend's metadata (None when the
        step is not all decodes, or another backend built it). The caller checks the KV layout.
        With `every_row`, any step: the rows of a sequence with several read its block table each, and
        the hidden states returned are those of `meta.output_rows` where the backend narrowed to them."""
        kernel = getattr(meta, "kernel", None)
        if kernel is None:
            return None
        rows = getattr(meta, "output_rows", None)
        if self.every_row:
            tables = kernel.block_tables
            counts = (kernel.q_start[1:] - kernel.q_start[:-1]).long()
            if bool((counts != 1).any()):
                tables = tables.repeat_interleave(counts, dim=0)
            h = self.run(input_ids, positions, tables, meta.slot_mapping, kv_caches, rope, max_position)
            return h if h is None or rows is None else h.index_select(0, rows)
        if rows is not None and rows.numel() != input_ids.shape[0]:
            return None
        if kernel.q_start.shape[0] != input_ids.shape[0] + 1:  # a sequence with more than one row
            return None
        return self.run(input_ids, positions, kernel.block_tables, meta.slot_mapping, kv_caches, rope, max_position)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
            slot_mapping: torch.Tensor, kv_caches: list, rope: Any, max_position: int) -> torch.Tensor | None:
        """Final-norm hidden states [B, H] of B single-token sequences (row b of `block_tables` is
        sequence b), or None when the step does not qualify (more rows than `max_rows`, a prefill row,
        caches in another layout): the caller then runs the per-op path."""
        b = input_ids.shape[0]
        if b == 0 or b > self.max_rows or block_tables.shape[0] != b or kv_caches[0] is None:
            return None
        k0 = kv_caches[0][0]
        if self._bound != k0.data_ptr():
            self.decoder.set_kv_caches([kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches])
            if len(kv_caches[0]) == 4:  # int8 caches: their scales (the decoder quantizes as it writes)
                self.decoder.set_kv_scales([kv[2] for kv in kv_caches], [kv[3] for kv in kv_caches])
            self._bound = k0.data_ptr()
        cos, sin = rope.full_tables(max_position)
        out = torch.empty(b, self.hidden_size, dtype=self.dtype)
        self.decoder.step(out, input_ids.long(), positions.long(), slot_mapping.long(), block_tables, cos, sin)
        return out


