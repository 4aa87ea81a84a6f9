"""One rank's share of a checkpoint for tensor and pipeline parallelism (vLLM's ColumnParallelLinear,
QKVParallelLinear, RowParallelLinear and VocabParallelEmbedding, applied to the weights at load).

The loaded checkpoint (Hugging Face names, float tensors or GGUF blocks) is cut once, before the
network is built, and the network is then built over the cut weights with a per-rank config
(heads, KV heads, intermediate size, layers of this rank), so the layer code is the same at every
size. Cuts, for TP rank r of N:

* q_proj (column-parallel): the rank's Hq / N query heads, rows of whole heads.
* k_proj, v_proj: Hkv / N KV heads when N divides Hkv; when N > Hkv (N a multiple of Hkv), one KV
  head, replicated on N / Hkv ranks (head r // (N / Hkv)): vLLM's QKVParallelLinear rule, which keeps
  every query head next to the KV head it reads. Each rank's KV cache holds its own KV heads only.
* o_proj, down_proj (row-parallel): the columns of the rank's heads / intermediate slice; each rank
  computes a partial sum and one all-reduce per linear adds them (RowParallelLinear, see
  tokenloom/model/parallel_linear.py); a bias stays on rank 0 only, so it is added once.
* gate_proj, up_proj (column-parallel): rows of the rank's intermediate slice.
* embed_tokens, lm_head (vocab-parallel): rows [r * Vp, (r + 1) * Vp) of the vocabulary padded to
  Vp = ceil(V / N) rows per rank (zero rows past V); the embedding masks ids outside its slice and
  all-reduces, the head's logits are all-gathered and cut back to V (every rank then samples the same
  token from the same logits).
* norms, q/k norms (per head_dim), rotary: replicated.

GGUF blocks are cut without requantizing: rows are whole blocks (column-parallel cuts are free);
row-parallel cuts along K must fall on block boundaries (32 elements for Q4_0..Q8_0, 256 for the
K-quants), else the cut is refused with the shapes in the message.

Pipeline stage s of M takes a contiguous range of layers (vLLM's get_pp_indices: L // M each, the
remainder to the stages before the last), renamed to start at 0 so the layer loop and the KV cache are
the stage's own. Families with per-layer windows or experts are refused (their layers are not
interchangeable by index, or have no tensor-parallel cut here yet).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenloom.model.config import ModelConfig

# The families whose layers are cut here (dense Llama-style attention + gated MLP).
PARALLEL_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ShardInfo:
    """Where one rank sits: its TP slice (vocab rows) and its PP stage (layer range)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vocab_size: int = 0  # the full vocabulary (the logits are cut back to it)
    vocab_per_rank: int = 0  # Vp: rows of the vocab-parallel embedding / head on each rank
    layer_start: int = 0
    layer_end: int = 0

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_per_rank

    @property
    def pp_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1 or self.pp_size > 1


@dataclass
class ShardedModel:
    """A LoadedModel's shape (config, weights) for one rank, with its ShardInfo."""

    config: ModelConfig
    weights: dict[str, Any]
    shard: ShardInfo
    source: str = ""
    path: Any = None


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vLLM's get_pp_indices: L // M layers per stage, one more for each of the `L % M` stages
    before the last (the last stage also runs the head)."""
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


def check_parallel_model(config: ModelConfig, tp_size: int, pp_size: int) -> None:
    """Refuse a model these sizes cannot cut, with the reason (before any weight is read)."""
    if tp_size == 1 and pp_size == 1:
        return
    if config.architecture not in PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor/pipeline parallelism covers {', '.join(PARALLEL_ARCHITECTURES)} models; "
                         f"{config.architecture} is not cut yet")
    if config.sliding_window is not None or config.layer_types is not None:
        raise ValueError("tensor/pipeline parallelism does not cover sliding-window layers yet")
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    if hq % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide the model's {hq} attention heads")
    if hkv % tp_size and tp_size % hkv:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide the model's {hkv} KV heads or be a "
                         "multiple of them (then KV heads are replicated, as vLLM)")
    if config.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide the intermediate size "
                         f"{config.intermediate_size}")
    if pp_size > config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {config.num_hidden_layers} layers")


def rank_config(config: ModelConfig, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> ModelConfig:
    """The config one rank's network is built from (its heads, slice and layers)."""
    start, end = pp_layer_range(config.num_hidden_layers, pp_rank, pp_size)
    return replace(config, num_attention_heads=config.num_attention_heads // tp_size,
                   num_key_value_heads=kv_heads_per_rank(config.num_key_value_heads, tp_size),
                   intermediate_size=config.intermediate_size // tp_size, num_hidden_layers=end - start)


def shard_model(loaded: Any, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> ShardedModel:
    """One rank's weights and config from a loaded checkpoint (see the module docstring)."""
    config: ModelConfig = loaded.config
    check_parallel_model(config, tp_size, pp_size)
    start, end = pp_layer_range(config.num_hidden_layers, pp_rank, pp_size)
    vocab = int(loaded.weights["model.embed_tokens.weight"].shape[0])  # the table's rows, as the runner checks
    per_rank = -(-vocab // tp_size)
    shard = ShardInfo(tp_rank, tp_size, pp_rank, pp_size, vocab, per_rank, start, end)
    d = config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    q_per = hq // tp_size
    kv_per = kv_heads_per_rank(hkv, tp_size)
    kv_first = tp_rank * kv_per if hkv >= tp_size else tp_rank // (tp_size // hkv)
    inter = config.intermediate_size // tp_size
    q_rows = (tp_rank * q_per * d, (tp_rank + 1) * q_per * d)
    kv_rows = (kv_first * d, (kv_first + kv_per) * d)
    i_rows = (tp_rank * inter, (tp_rank + 1) * inter)
    out: dict[str, Any] = {}
    for name, w in loaded.weights.items():
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if not start <= layer < end:
                continue
            local = f"model.layers.{layer - start}." + name.split(".", 3)[3]
            out[local] = _cut_layer_weight(name, w, tp_rank, q_rows, kv_rows, i_rows)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, tp_rank * per_rank, per_rank) if tp_size > 1 else w
        else:
            out[name] = w
    return ShardedModel(rank_config(config, tp_size, pp_rank, pp_size), out, shard,
                        getattr(loaded, "source", ""), getattr(loaded, "path", None))


def _cut_layer_weight(name: str, w: Any, tp_rank: int, q_rows: tuple[int, int], kv_rows: tuple[int, int],
                      i_rows: tuple[int, int]) -> Any:
    kind = name.rsplit(".", 2)[-2]  # q_proj, o_proj, ..., input_layernorm
    is_bias = name.endswith(".bias")
    if kind == "q_proj":
        return _rows(w, *q_rows)
    if kind in ("k_proj", "v_proj"):
        return _rows(w, *kv_rows)
    if kind in ("gate_proj", "up_proj"):
        return _rows(w, *i_rows)
    if kind in ("o_proj", "down_proj"):
        if is_bias:  # added once: on rank 0, after the others' partial sums are zero-biased
            return w if tp_rank == 0 else torch.zeros_like(w)
        return _cols(w, *(q_rows if kind == "o_proj" else i_rows), name)
    return w  # norms (q_norm / k_norm are per head_dim): replicated


def _is_gguf(w: Any) -> bool:
    return hasattr(w, "qtype") and hasattr(w, "data")


def _rows(w: Any, start: int, end: int) -> Any:
    if _is_gguf(w):
        from tokenloom.model.gguf_weights import GGUFWeight

        if w.packed8:
            raise ValueError("cannot cut a GGUF matrix already in the 8-row layout")
        return GGUFWeight(w.data[start:end].clone(), w.qtype, (end - start, w.shape[1]))
    # A copy, not a view: a view would keep the whole checkpoint tensor alive in every rank.
    return w[start:end].clone()


def _cols(w: Any, start: int, end: int, name: str) -> Any:
    if _is_gguf(w):
        from gguf import GGML_QUANT_SIZES

        from tokenloom.model.gguf_weights import GGUFWeight

        block, type_size = GGML_QUANT_SIZES[w.qtype]
        if start % block or end % block:
            raise ValueError(f"{name}: a row-parallel cut at columns [{start}, {end}) of a {tuple(w.shape)} GGUF "
                             f"matrix must fall on whole {block}-element quant blocks; choose a tensor_parallel_size "
                             "whose slices are multiples of it, or --quantization none")
        data = w.data[:, start // block * type_size : end // block * type_size].contiguous()
        return GGUFWeight(data, w.qtype, (w.shape[0], end - start))
    return w[:, start:end].contiguous()


def _vocab_rows(w: Any, start: int, per_rank: int) -> Any:
    """Rows [start, start + per_rank) of the vocabulary, padded with zero rows past its end."""
    n = int(w.shape[0])
    end = min(start + per_rank, n)
    part = _rows(w, start, end)
    missing = per_rank - (end - start)
    if missing <= 0:
        return part
    if _is_gguf(part):
        from tokenloom.model.gguf_weights import GGUFWeight

        # All-zero blocks dequantize to zeros in every GGUF type (scale 0, min 0).
        pad = torch.zeros((missing, part.data.shape[1]), dtype=part.data.dtype)
        return GGUFWeight(torch.cat([part.data, pad]), part.qtype, (per_rank, part.shape[1]))
    return torch.cat([part, part.new_zeros((missing, part.shape[1]))])
