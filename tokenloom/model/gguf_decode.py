"""The batch-1 (and small-batch) decode step of a GGUF model in one compiled call.

`GGUFDecoder` (csrc/gguf_kernels.cpp) holds the whole stack: every layer's norms and quantized
linears (q/k/v and gate/up each one matrix where their GGML types agree) and the KV caches; a decode
step is one `step()` call, so no Python runs per op or per layer. `build_decoder` assembles it from
`load_gguf_quantized`'s weights. Rows it handles: decodes only (one new token per sequence), up to
`MAX_DECODE_ROWS`; anything else (prefill chunks, mixed steps, bigger batches) runs the per-op path.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf_weights import GGUFWeight

DENSE = 0  # part type of a float32 matrix


def max_decode_rows() -> int:
    """Decode batches up to this size take the fused step (TOKENLOOM_GGUF_FUSED_ROWS; 0 turns it off)."""
    return int(os.environ.get("TOKENLOOM_GGUF_FUSED_ROWS", "8"))


Part = tuple[torch.Tensor, int, "torch.Tensor | None"]


def _parts(weights: dict[str, Any], names: list[str], biases: list[str]) -> list[Part]:
    """[(data, type, bias)] for the row blocks `names`; consecutive parts of one GGML type merged."""
    out: list[Part] = []
    for name, bias_name in zip(names, biases):
        w = weights[name]
        bias = weights.get(bias_name)
        bias = None if bias is None else bias.float().contiguous()
        data, qtype = (w.data, w.qtype) if isinstance(w, GGUFWeight) else (w.float().contiguous(), DENSE)
        if out and out[-1][1] == qtype:
            prev_data, _, prev_bias = out[-1]
            if prev_bias is not None or bias is not None:
                prev_bias = prev_bias if prev_bias is not None else torch.zeros(prev_data.shape[0])
                bias = torch.cat([prev_bias, bias if bias is not None else torch.zeros(data.shape[0])])
            out[-1] = (torch.cat([prev_data, data]), qtype, bias)
        else:
            out.append((data, qtype, bias))
    return out


def build_decoder(kernels: Any, config: ModelConfig, weights: dict[str, Any]) -> Any:
    """A GGUFDecoder over `weights` (HF names; GGUFWeight or float tensors). KV caches come later
    (`set_kv_caches`), once the runner has allocated them."""
    embed = weights["model.embed_tokens.weight"]
    if isinstance(embed, GGUFWeight):
        embed_data, embed_type = embed.data, embed.qtype
    else:
        embed_data, embed_type = embed.float().contiguous(), DENSE
    dec = kernels.GGUFDecoder(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                              config.head_dim, config.intermediate_size, config.rms_norm_eps, embed_data, embed_type,
                              weights["model.norm.weight"].float().contiguous())
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        dec.add_layer(
            weights[p + "input_layernorm.weight"].float().contiguous(),
            _parts(weights, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                   [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            _parts(weights, [a + "o_proj.weight"], [a + "o_proj.bias"]),
            weights[p + "post_attention_layernorm.weight"].float().contiguous(),
            _parts(weights, [m + "gate_proj.weight", m + "up_proj.weight"], [m + "gate_proj.bias", m + "up_proj.bias"]),
            _parts(weights, [m + "down_proj.weight"], [m + "down_proj.bias"]),
        )
    return dec


class GGUFDecodeStep:
    """The model's fast path for small all-decode steps: binds the runner's KV caches to the
    decoder once and runs `step()` when the step qualifies (see `run`)."""

    def __init__(self, decoder: Any, hidden_size: int, dtype: torch.dtype) -> None:
        self.decoder = decoder
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_rows = max_decode_rows()
        self._bound: int | None = None  # data_ptr of the first K cache bound to the decoder

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
            self._bound = k0.data_ptr()
        cos, sin = rope.full_tables(max_position)
        out = torch.empty(b, self.hidden_size, dtype=self.dtype)
        self.decoder.step(out, input_ids, positions, slot_mapping, block_tables, cos, sin)
        return out

