"""Attention over a paged KV cache, in plain torch: the same code runs on CPU and CUDA tensors.

KV layout (per layer, one K and one V tensor, views of a single allocation):

    [num_kv_heads, num_blocks, block_size, head_dim]      ("head-major")

A token's slot is `block_id * block_size + offset`; viewed as [num_kv_heads, num_blocks * block_size,
head_dim] a slot is one row per head. Head-major rather than vLLM's [num_blocks, block_size,
num_kv_heads, head_dim]: gathering whole blocks along dim 1 lands a request's context directly in
the [kv_heads, requests, keys, head_dim] shape the attention GEMMs want, with no transpose copy.
Measured on the 2-core Zen 4 dev box, decode attention for 32 requests x 300 tokens of
SmolLM2-135M's shape: 1.2 ms vs 3.0 ms (bf16), 3.2 ms vs 6.4 ms (fp32) per layer.

One step's flattened batch is laid out decode groups first (one token per request), then prefill
chunks:

* decodes: single-token requests, in groups of similar context length (the runner forms them),
  one padded call per group: gather the group's blocks, then matmul -> fp32 masked softmax ->
  matmul. The kv heads are the GEMM batch and the G query heads sharing a kv head are the rows of
  one small GEMM, so GQA needs no repeat of K/V. This beat SDPA's CPU flash kernel ~2x here: with
  one query per request the kernel's per-(request, head) overhead dominates. The cost is memory
  traffic: the gather writes every context once more before the GEMMs read it (a fused paged
  kernel would read it once).
* prefill chunks (more than one token, possibly starting at num_computed_tokens > 0): one SDPA
  call per request over its gathered context with enable_gqa, 4-D inputs (the only shape torch's
  CPU dispatcher sends to the flash kernel). Chunks starting at 0 use is_causal; later chunks pass
  a bottom-right-aligned causal bool mask (query i at position start + i sees keys 0..start + i),
  which the flash kernel runs ~2x slower than is_causal.

Everything the layers share (block tables, masks) is built once per step in `TorchAttentionMetadata`.

On CPU, when the compiled kernels are available (tokenloom/model/kernels.py), one fused call per
layer serves the whole step instead (`paged_attention_fused`, metadata in `KernelAttentionMetadata`): every
query row (a decode, or a row of a prefill chunk; a chunk's rows go four at a time) reads its keys
and values straight from the blocks through its sequence's block table, with no gather copy, no
padding and no masks (a chunk continuing a cached prefix is just rows whose keys start earlier);
the G query heads of a kv head share each K/V read (GQA); scores, softmax and accumulation are
fp32. For bf16 on AVX512-BF16 CPUs with block_size % 16 == 0 the runner stores the cache in a
"packed" layout (same tensor shape, elements reordered within each block, see `pack_kv_layout`)
that turns both products into AVX512-BF16 dot-product instructions with no horizontal sums; only
the kernels read it. Decode attention per step (batch 128, contexts 64..512, SmolLM2-135M, bf16,
one thread): 230 ms with the gather path, 75 ms fused (plain layout), ~60 ms packed; it is then
bound by memory bandwidth (each step reads every context once). The pure-torch path above stays
as the reference and the fallback (CUDA, or no compiler).

Which of the two a model runs, and the metadata each builds, is an `AttentionBackend`
(tokenloom/model/attention_backends.py); this module holds the arithmetic and the metadata types.

16-bit KV cache (--kv-cache-dtype bfloat16 / float16): K and V stored in that type whatever the run
dtype; the writers round to it (round to nearest even), the readers convert rows back as they read
(the kernels per key tile or row, the torch path per gathered block). Scores, softmax and sums stay
fp32 (the kernels) or the run dtype (the torch path), as with a cache of the run dtype.

int8 KV cache (--kv-cache-dtype int8, docs/kv_cache.md): K and V hold int8 values in the same
[Hkv, num_blocks, block_size, D] shape and each layer's KVCache carries two more tensors, the
float32 scales [Hkv, num_blocks, block_size] of K and V, one per (token, kv head): value = q * scale,
scale = absmax / 127 of the row, rounded to nearest even. Both are indexed by block id on dim 1, so
a block's KV is (values, scales) at one index of a fixed set of tensors. The writers quantize
(`quantize_kv` here, the kernels' rotary_and_cache and the fused decode step); the torch path
dequantizes whole gathered blocks, the kernels fold the scales into scores and probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.config import kv_cache_row_bytes
from tokenloom.core.kv_cache_groups import KVCacheGroupSpec, layers_per_block
from tokenloom.model.config import ModelConfig

# (K, V), each [num_kv_heads, num_blocks, block_size, head_dim]; an int8 cache adds (K scales, V scales),
# each [num_kv_heads, num_blocks, block_size] float32.
KVCache = tuple[torch.Tensor, ...]
KV_SCALE_DTYPE = torch.float32  # config.KV_SCALE_BYTES per scale


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What differs between layers' attention (Gemma, Mistral): the score scale, the sliding window
    (a query at position p sees keys p - window + 1 .. p; None: all of 0 .. p) and Gemma 2's tanh
    soft-capping of the scores (None: off). The default is Llama's."""

    scale: float | None = None  # None: head_dim ** -0.5
    window: int | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None


@dataclass
class DecodeMetadata:
    """A group of single-token requests served by one padded attention call.

    Decodes are grouped by context length (see the runner) so that padding to the group's longest
    context stays small.
    """

    token_start: int  # offset of the group's first token in the flattened batch
    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs * max_blocks] long, flattened, padded with block 0
    max_blocks: int
    key_bias: torch.Tensor  # [1, num_seqs, 1, max_blocks * block_size] fp32: 0 = attend, -inf = padding
    query_pos: torch.Tensor | None = None  # [num_seqs] long: each decode's position (for windows)
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # key_bias with a window, per window

    def bias(self, window: int | None) -> torch.Tensor:
        """key_bias, with keys before the window also hidden (built once per step and window)."""
        if window is None:
            return self.key_bias
        if window not in self.window_bias:
            assert self.query_pos is not None
            keys = torch.arange(self.key_bias.shape[-1], device=self.key_bias.device)
            outside = keys[None, :] <= (self.query_pos[:, None] - window)
            self.window_bias[window] = self.key_bias.masked_fill(outside.view(1, self.num_seqs, 1, -1), -torch.inf)
        return self.window_bias[window]


@dataclass
class PrefillMetadata:
    """One multi-token chunk of one request: queries at positions start..start+n-1."""

    token_start: int  # offset of the chunk's first token in the flattened batch
    num_tokens: int
    context_len: int  # start + num_tokens: keys 0..context_len-1
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long
    mask: torch.Tensor | None  # [num_tokens, context_len] bool; None: plain causal (start == 0)
    window_mask: dict[int, torch.Tensor] = field(default_factory=dict)  # per window, built on first use

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The chunk's causal mask, restricted to a sliding window when one is given."""
        if window is None:
            return self.mask
        if window not in self.window_mask:
            start = self.context_len - self.num_tokens
            keys = torch.arange(self.context_len, device=self.block_ids.device)
            queries = torch.arange(start, self.context_len, device=self.block_ids.device)
            self.window_mask[window] = (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)
        return self.window_mask[window]


@dataclass
class KernelMetadata:
    """The whole step for the fused kernel: sequences in flat-batch order, each a run of query rows.

    Row j of sequence s (flat row q_start[s] + j) is at position pos_start[s] + j and sees keys
    0 .. pos_start[s] + j (causal, so a chunk continuing a cached prefix needs no mask).
    """

    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0 (never read past a row's context)
    q_start: torch.Tensor  # [S + 1] int32
    pos_start: torch.Tensor  # [S] int32


@dataclass
class AttentionMetadata:
    """What every backend's metadata has; each backend subclasses it with its own fields and builds
    it itself (tokenloom/model/attention_backends.py)."""

    slot_mapping: torch.Tensor  # [T] long: where each token's K/V is written
    # When set, the last layer writes every row's K/V, then continues with these rows alone (in
    # this order): the forward returns the final hidden states of the sampling rows only.
    output_rows: torch.Tensor | None = None


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The pure-torch backend's step: padded decode groups, then prefill chunks."""

    decodes: list[DecodeMetadata] = field(default_factory=list)
    prefills: list[PrefillMetadata] = field(default_factory=list)


@dataclass
class KernelAttentionMetadata(AttentionMetadata):
    """The fused CPU kernel backend's step. `output_kernel`: with output_rows, the last layer's
    attention metadata for those rows (one query row each)."""

    kernel: KernelMetadata | None = None
    output_kernel: KernelMetadata | None = None


@dataclass
class CommonAttentionMetadata:
    """The step's sequences in flat-batch order, as numpy arrays (vLLM's name): what the runner
    hands every backend's `build_metadata`."""

    query_start_loc: np.ndarray  # [S + 1] int64: sequence s owns flat rows q[s] .. q[s + 1] - 1
    num_computed_tokens: np.ndarray  # [S] int64: position of each sequence's first row
    block_table: np.ndarray  # [S, max_blocks] int32, each row padded with block 0
    slot_mapping: np.ndarray  # [T] int64
    samples: np.ndarray  # [S] bool: the sequence's last row samples a token
    block_size: int
    # Speculative decoding: drafts each sequence verifies ([S] int64; None: none). A sampling
    # sequence with d drafts needs the outputs of its last 1 + d rows.
    num_drafts: np.ndarray | None = None

    @property
    def seq_ends(self) -> np.ndarray:
        return self.num_computed_tokens + np.diff(self.query_start_loc)

    @property
    def output_rows(self) -> np.ndarray:
        """Flat rows whose outputs are needed, in order: each sampling sequence's last 1 + d rows."""
        ends = self.query_start_loc[1:][self.samples]
        if self.num_drafts is None:
            return ends - 1
        counts = 1 + self.num_drafts[self.samples]
        starts = np.repeat(ends - counts, counts)
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return starts + within

    @property
    def output_positions(self) -> np.ndarray:
        """Token position of each output row (a one-token query at its own position)."""
        rows = self.output_rows
        seq = np.searchsorted(self.query_start_loc, rows, side="right") - 1
        return self.num_computed_tokens[seq] + rows - self.query_start_loc[seq]

    @property
    def output_seqs(self) -> np.ndarray:
        """The sequence of each output row."""
        return np.searchsorted(self.query_start_loc, self.output_rows, side="right") - 1


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                             num_layers: int | None = None, cache_dtype: str = "auto") -> int:
    """Bytes one block takes, K and V (and an int8 cache's scales), across all layers or the
    `num_layers` one block holds (with hybrid KV cache groups, the layers of one group:
    tokenloom/core/kv_cache_groups.py)."""
    elem = torch.empty((), dtype=dtype).element_size()
    row = kv_cache_row_bytes(config.head_dim, elem, cache_dtype)
    per_layer = 2 * block_size * config.num_key_value_heads * row
    return per_layer * (config.num_hidden_layers if num_layers is None else num_layers)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    zeroed: bool = True,
    kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    cache_dtype: str = "auto",
) -> list[KVCache]:
    """One allocation, handed out as a (K, V) pair of views per layer (`cache_dtype` "int8": int8
    values, and a second allocation of float32 scales handed out as (K scales, V scales) after them).

    With KV cache groups (tokenloom/core/kv_cache_groups.py) a block holds one group's layers:
    the allocation has `layers_per_block` slots and layer `group.layer_ids[j]` of every group uses
    slot j, addressed through its own group's block table (vLLM's shared KV cache tensors). One
    group of every layer (the default) is one slot per layer.

    Zeroed for the torch path: its padded decode slots read stale rows, and masked-out garbage must
    not be NaN/Inf (0 * NaN would poison the softmax-weighted sum). The fused kernels never let an
    unwritten slot reach a result, so they take `zeroed=False`: an uninitialised allocation, whose
    pages the OS maps on first write instead of a 2 GiB memset at start-up (~0.8 s here).
    """
    groups = kv_cache_groups or [KVCacheGroupSpec(tuple(range(config.num_hidden_layers)))]
    slot_of = {layer: j for g in groups for j, layer in enumerate(g.layer_ids)}
    if sorted(slot_of) != list(range(config.num_hidden_layers)):
        raise ValueError(f"the KV cache groups must cover each of the {config.num_hidden_layers} layers once")
    shape = (layers_per_block(groups), 2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    make = torch.zeros if zeroed else torch.empty
    if cache_dtype == "int8":
        values = make(shape, dtype=torch.int8, device=device)
        scales = make(shape[:-1], dtype=KV_SCALE_DTYPE, device=device)
        return [(values[slot_of[i], 0], values[slot_of[i], 1], scales[slot_of[i], 0], scales[slot_of[i], 1])
                for i in range(config.num_hidden_layers)]
    full = make(shape, dtype=kv_storage_dtype(dtype, cache_dtype), device=device)
    return [(full[slot_of[i], 0], full[slot_of[i], 1]) for i in range(config.num_hidden_layers)]


def kv_storage_dtype(run_dtype: torch.dtype, cache_dtype: str = "auto") -> torch.dtype:
    """The element type K and V are stored in: the run dtype for "auto", the 16-bit type named, int8."""
    named = {"bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
    return named.get(cache_dtype, run_dtype)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] rows -> (int8 [..., D], float32 scales [...]): symmetric per row, scale = absmax / 127,
    round to nearest even; the kernels' quantize_kv_row in the same float32 arithmetic, so either
    writer stores the same bytes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # A float32 tensor / tensor division: `127.0 / amax` (a Python scalar over a tensor) takes a path that
    # can land an ulp off the IEEE quotient the kernels compute, flipping a .5 tie now and then.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D] x float32 scales [...] -> [..., D] in `dtype` (the run dtype)."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([T, num_kv_heads, head_dim]) at their slots (an int8 cache: quantized,
    with their scales)."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    if len(kv_cache) == 4:
        for cache, scales, x in ((k_cache, kv_cache[2], k), (v_cache, kv_cache[3], v)):
            q, s = quantize_kv(x.transpose(0, 1))
            cache.view(num_heads, -1, head_dim).index_copy_(1, slot_mapping, q)
            scales.view(num_heads, -1).index_copy_(1, slot_mapping, s)
        return
    # A 16-bit cache under another run dtype: rounded to the cache's type on the way in.
    k_cache.view(num_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(num_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: TorchAttentionMetadata,
    spec: AttentionLayerSpec | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of this step -> attention output [T, Hq * D].

    Writes k/v into the cache first, then reads every query's context (cached + new) from it.
    `spec`: the layer's scale, sliding window and soft-capping (default: Llama's).
    """
    spec = spec or AttentionLayerSpec()
    write_kv(kv_cache, k, v, meta.slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    for group in meta.decodes:
        s, e = group.token_start, group.token_start + group.num_seqs
        out[s:e] = _decode_attention(q[s:e], kv_cache, group, spec)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_start + chunk.num_tokens
        out[s:e] = _prefill_attention(q[s:e], kv_cache, chunk, spec)
    return out


def paged_attention_fused(
    kernels: Any, qkv: torch.Tensor, num_q_heads: int, kv_cache: KVCache, meta: KernelMetadata, packed: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Fused CPU kernel: q heads read from the fused qkv rows [T, (Hq + 2 Hkv) * D] (already
    rotated, K/V already in the cache) -> attention output [T, Hq * D]. `packed`: the cache holds
    the packed bf16 layout (see `pack_kv_layout`). An int8 cache's scales go with it."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_scale, v_scale = (kv_cache[2], kv_cache[3]) if len(kv_cache) == 4 else (None, None)
    head_dim = k_cache.shape[-1]
    out = torch.empty(qkv.shape[0], num_q_heads * head_dim, dtype=qkv.dtype)
    kernels.paged_attention(out, qkv, k_cache, v_cache, meta.block_tables, meta.q_start, meta.pos_start,
                            head_dim**-0.5 if scale is None else scale, packed, k_scale, v_scale)
    return out


def pack_kv_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVCache:
    """Plain [Hkv, NB, bs, D] caches -> the kernels' packed bf16 layout, same shape, elements
    reordered within each block: K as [D/2][bs][2] (16 keys of a dim pair fill one vector), V as
    [bs/2][D][2] (two tokens interleaved per dim). The runner writes this layout directly
    (rotary_and_cache); this is the reference the tests hold it to."""
    h, nb, bs, d = k_cache.shape
    k = k_cache.view(h, nb, bs, d // 2, 2).permute(0, 1, 3, 2, 4).contiguous().view(h, nb, bs, d)
    v = v_cache.view(h, nb, bs // 2, 2, d).permute(0, 1, 2, 4, 3).contiguous().view(h, nb, bs, d)
    return k, v


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] -> [Hkv, len(block_ids) * bs, D], whole blocks at a time, in `dtype`: an
    int8 cache's blocks dequantized with their `scales`, a 16-bit cache's converted (the gathered copy
    is made anyway)."""
    num_heads, _, block_size, head_dim = cache.shape
    out = cache.index_select(1, block_ids)
    if scales is not None:
        out = dequantize_kv(out, scales.index_select(1, block_ids), dtype)
    elif out.dtype != dtype:
        out = out.to(dtype)
    return out.view(num_heads, block_ids.numel() * block_size, head_dim)


def _gather_kv(kv_cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A context's K and V blocks, [Hkv, len(block_ids) * bs, D] each, in `dtype`."""
    if len(kv_cache) == 4:
        return (_gather_blocks(kv_cache[0], block_ids, dtype, kv_cache[2]),
                _gather_blocks(kv_cache[1], block_ids, dtype, kv_cache[3]))
    return _gather_blocks(kv_cache[0], block_ids, dtype), _gather_blocks(kv_cache[1], block_ids, dtype)


def _decode_attention(q: torch.Tensor, kv_cache: KVCache, meta: DecodeMetadata,
                      spec: AttentionLayerSpec) -> torch.Tensor:
    """Unfused matmul-softmax-matmul: with q_len of one, SDPA's CPU flash kernel spends its time on
    per-(request, head) overhead; plain batched GEMMs were ~2x faster here."""
    num_kv_heads, head_dim = kv_cache[0].shape[0], kv_cache[0].shape[-1]
    b = meta.num_seqs
    group = q.shape[1] // num_kv_heads
    k, v = _gather_kv(kv_cache, meta.block_tables, q.dtype)
    k, v = k.view(num_kv_heads, b, -1, head_dim), v.view(num_kv_heads, b, -1, head_dim)
    # [B, Hq, D] -> [Hkv, B, G, D]: the G query heads sharing a kv head are the rows of one small
    # GEMM against that head's keys, so GQA needs no repeat of K/V.
    qh = q.view(b, num_kv_heads, group, head_dim).transpose(0, 1)
    # Scores come out of the GEMM in the run dtype (as in HF's eager attention); scale, mask and
    # softmax run in fp32.
    scores = torch.matmul(qh, k.transpose(-1, -2)).float()
    scores.mul_(spec.scale if spec.scale is not None else head_dim**-0.5)
    if spec.softcap is not None:  # Gemma 2: cap * tanh(scores / cap), before the mask (as HF)
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores.add_(meta.bias(spec.window))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    o = torch.matmul(probs, v)  # [Hkv, B, G, D]
    return o.transpose(0, 1).reshape(b, num_kv_heads * group * head_dim)


def _prefill_attention(q: torch.Tensor, kv_cache: KVCache, meta: PrefillMetadata,
                       spec: AttentionLayerSpec) -> torch.Tensor:
    n, num_q_heads, head_dim = q.shape
    # 4-D inputs: with 3-D ones torch's CPU dispatcher falls back to the unfused math kernel.
    k, v = _gather_kv(kv_cache, meta.block_ids, q.dtype)
    k, v = k[:, : meta.context_len].unsqueeze(0), v[:, : meta.context_len].unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    mask = meta.mask_for(spec.window)
    if spec.softcap is not None:
        o = eager_attention(qh, k, v, mask if mask is not None else causal_offset_mask(0, n, q.device), spec)
    elif mask is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True, scale=spec.scale)
    else:
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True, scale=spec.scale)
    return o[0].transpose(0, 1).reshape(n, num_q_heads * head_dim)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     spec: AttentionLayerSpec) -> torch.Tensor:
    """[1, Hq, n, D] x [1, Hkv, L, D] -> [1, Hq, n, D] with scores soft-capped (SDPA cannot):
    HF's eager Gemma 2 arithmetic (scale, cap * tanh(s / cap), mask, fp32 softmax)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (spec.scale if spec.scale is not None else q.shape[-1] ** -0.5)
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, -torch.inf)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def causal_offset_mask(start: int, num_tokens: int, device: torch.device | str) -> torch.Tensor:
    """[n, start + n] bool: query i (position start + i) sees keys 0..start + i."""
    keys = torch.arange(start + num_tokens, device=device)
    queries = torch.arange(start, start + num_tokens, device=device)
    return keys[None, :] <= queries[:, None]
