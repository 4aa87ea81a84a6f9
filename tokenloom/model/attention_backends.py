"""Attention backends: how a layer's attention runs, and the per-step metadata that takes.

A backend does, for one layer and the whole step, rotary embedding of q/k + the KV-cache write +
paged attention, starting from the fused qkv projection's output [T, (Hq + 2 Hkv) * D]. The runner
hands it the step's sequences (`reorder_batch`, then `build_metadata` from a
`CommonAttentionMetadata`): each backend builds its own metadata type.

* `TorchAttentionBackend`: plain torch (CPU or CUDA), decodes in padded groups of similar context
  length placed first, prefill chunks through SDPA (tokenloom/model/attention.py).
* `CpuKernelAttentionBackend`: the compiled CPU kernels, one fused call per layer, scheduler order,
  and the last layer restricted to the sampling rows.
* `DenseCausalAttentionBackend`: one sequence from position 0 with no KV cache (SDPA, causal): the
  SmoothQuant calibration forward (tokenloom/model/smoothquant.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.model.attention import (
    AttentionLayerSpec,
    AttentionMetadata,
    CommonAttentionMetadata,
    DecodeMetadata,
    KernelAttentionMetadata,
    KernelMetadata,
    KVCache,
    PrefillMetadata,
    TorchAttentionMetadata,
    causal_offset_mask,
    eager_attention,
    paged_attention,
    paged_attention_fused,
)
from tokenloom.model.rotary import RotaryEmbedding


class ScheduledSeq(Protocol):
    start: int  # num_computed_tokens before this step
    num_tokens: int


S = TypeVar("S", bound=ScheduledSeq)


class AttentionBackend(ABC):
    """One model's attention: heads and head size fixed at construction, `forward` per layer."""

    # Whether the KV cache must start zeroed (a backend that can read unwritten slots needs it).
    zeroed_kv_cache: bool = True

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.device = device

    def reorder_batch(self, seqs: list[S]) -> list[S]:
        """The flat-batch order this backend wants the step's sequences in (default: as scheduled)."""
        return seqs

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """This backend's metadata for the step (built once, shared by all layers)."""

    @abstractmethod
    def rope_tables(self, rope: RotaryEmbedding, positions: torch.Tensor, max_position: int) -> Any:
        """What `forward` reads for the rotary embedding (computed once per step)."""

    @abstractmethod
    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rope_tables: Any, kv_cache: KVCache | None,
                meta: AttentionMetadata, last_layer: bool,
                spec: AttentionLayerSpec | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qkv [T, (Hq + 2 Hkv) * D] -> (attention output [rows, Hq * D], rows). Writes this step's
        K/V. `rows` is None when every row goes on; in the last layer with `meta.output_rows` set,
        it is those rows (and the output has them alone). `spec`: the layer's scale, sliding window
        and soft-capping (None: Llama's); see `supports`."""

    def supports(self, spec: AttentionLayerSpec) -> bool:
        """Whether this backend runs layers with `spec` (the torch ones run every spec)."""
        return True


class TorchAttentionBackend(AttentionBackend):
    """The reference path: plain torch ops (see attention.py for the decode grouping and masks)."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, device)
        # Bounds on the decodes sharing one padded attention call (see split_decode_groups).
        self.decode_group_min, self.decode_group_max = 16, 32

    def reorder_batch(self, seqs: list[S]) -> list[S]:
        """Decodes first, longest context first (so groups of similar length are neighbours), then
        prefill chunks in scheduler order."""
        decodes = sorted((s for s in seqs if s.num_tokens == 1), key=lambda s: s.start, reverse=True)
        return decodes + [s for s in seqs if s.num_tokens > 1]

    def split_decode_groups(self, starts: list[int]) -> list[int]:
        """Group sizes for decodes at these (descending) start positions.

        Each group costs one padded attention call per layer, padded to its longest context. A group
        closes once the next context is under half its longest and it has `decode_group_min` members
        (smaller calls cost more in launch overhead than the padding they save), or at
        `decode_group_max` members: the gathered K/V of a group that size stays in cache for the two
        GEMMs that read it (~15% faster decode attention than one call over 128 requests on this CPU).
        """
        sizes: list[int] = []
        first = 0
        for start in starts:
            if sizes and not (sizes[-1] >= self.decode_group_max
                              or (sizes[-1] >= self.decode_group_min and 2 * (start + 1) < first + 1)):
                sizes[-1] += 1
            else:
                sizes.append(1)
                first = start
        return sizes

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl, starts = common.query_start_loc, common.num_computed_tokens
        counts = np.diff(qsl)
        num_decodes = int(np.argmax(counts > 1)) if (counts > 1).any() else len(counts)
        decodes: list[DecodeMetadata] = []
        first = 0
        for size in self.split_decode_groups(starts[:num_decodes].tolist()):
            decodes.append(self._decode_group(common, first, first + size))
            first += size
        prefills = [self._prefill_chunk(common, i) for i in range(num_decodes, len(counts))]
        return TorchAttentionMetadata(slot_mapping=self._to_device(common.slot_mapping), decodes=decodes,
                                      prefills=prefills)

    def _decode_group(self, common: CommonAttentionMetadata, a: int, b: int) -> DecodeMetadata:
        bs = common.block_size
        pos = common.num_computed_tokens[a:b]
        max_blocks = int((pos // bs + 1).max())
        # Padding points at block 0: a valid block whose contents the key bias hides.
        tables = common.block_table[a:b, :max_blocks].astype(np.int64)
        key_bias = np.where(np.arange(max_blocks * bs)[None, :] <= pos[:, None], 0.0, -np.inf)
        n = b - a
        return DecodeMetadata(
            token_start=int(common.query_start_loc[a]),
            num_seqs=n,
            block_tables=self._to_device(tables.reshape(-1)),
            max_blocks=max_blocks,
            key_bias=torch.from_numpy(key_bias.astype(np.float32)).view(1, n, 1, -1).to(self.device),
            query_pos=self._to_device(pos),
        )

    def _prefill_chunk(self, common: CommonAttentionMetadata, i: int) -> PrefillMetadata:
        bs = common.block_size
        start = int(common.num_computed_tokens[i])
        n = int(common.query_start_loc[i + 1] - common.query_start_loc[i])
        table = common.block_table[i, : -(-(start + n) // bs)]
        return PrefillMetadata(
            token_start=int(common.query_start_loc[i]),
            num_tokens=n,
            context_len=start + n,
            block_ids=self._to_device(table),
            mask=causal_offset_mask(start, n, self.device) if start > 0 else None,
        )

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def rope_tables(self, rope: RotaryEmbedding, positions: torch.Tensor, max_position: int) -> Any:
        return rope.tables(positions, max_position)

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rope_tables: Any, kv_cache: KVCache | None,
                meta: AttentionMetadata, last_layer: bool,
                spec: AttentionLayerSpec | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert isinstance(meta, TorchAttentionMetadata) and kv_cache is not None
        t = qkv.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_tables
        # Rotate q and k together: one set of elementwise kernels for both.
        qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        return paged_attention(qk[:, :hq], qk[:, hq:], v, kv_cache, meta, spec), None


class CpuKernelAttentionBackend(AttentionBackend):
    """The compiled CPU kernels: rotary + KV write in one call, paged attention in another.
    `kv_packed`: the cache holds the kernels' packed bf16 layout (set by the runner, which
    allocates the cache; see attention.pack_kv_layout)."""

    zeroed_kv_cache = False  # the kernels never let an unwritten slot reach a result

    def __init__(self, kernels: ModuleType, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, device)
        self.kernels = kernels
        self.kv_packed = False

    def build_metadata(self, common: CommonAttentionMetadata) -> KernelAttentionMetadata:
        q_start, starts, tables = common.query_start_loc, common.num_computed_tokens, common.block_table
        meta = KernelAttentionMetadata(
            slot_mapping=torch.from_numpy(common.slot_mapping),
            kernel=KernelMetadata(
                block_tables=torch.from_numpy(tables),
                q_start=torch.from_numpy(q_start.astype(np.int32)),
                pos_start=torch.from_numpy(starts.astype(np.int32)),
            ),
        )
        sample_rows = common.output_rows
        if len(sample_rows) < int(q_start[-1]):
            # Only the sampling rows' last-layer outputs are needed: the last layer writes every
            # row's K/V, then runs attention, o-proj and MLP on those rows alone, each a one-token
            # query at its own position (a draft-verification row sees the drafts before it, whose
            # K/V this layer has just written).
            meta.output_rows = torch.from_numpy(np.ascontiguousarray(sample_rows))
            meta.output_kernel = KernelMetadata(
                block_tables=torch.from_numpy(np.ascontiguousarray(tables[common.output_seqs])),
                q_start=torch.arange(len(sample_rows) + 1, dtype=torch.int32),
                pos_start=torch.from_numpy(common.output_positions.astype(np.int32)),
            )
        return meta

    def rope_tables(self, rope: RotaryEmbedding, positions: torch.Tensor, max_position: int) -> Any:
        return rope.full_tables(max_position)  # the kernel indexes them by position itself

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rope_tables: Any, kv_cache: KVCache | None,
                meta: AttentionMetadata, last_layer: bool,
                spec: AttentionLayerSpec | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert isinstance(meta, KernelAttentionMetadata) and meta.kernel is not None and kv_cache is not None
        assert spec is None or self.supports(spec), "the fused kernel has no sliding window or soft-capping"
        cos, sin = rope_tables
        hq = self.num_q_heads
        scales = (kv_cache[2], kv_cache[3]) if len(kv_cache) == 4 else (None, None)  # an int8 cache's
        self.kernels.rotary_and_cache(qkv, positions, cos, sin, hq, kv_cache[0], kv_cache[1], meta.slot_mapping,
                                      self.kv_packed, *scales)
        kernel_meta, rows = meta.kernel, None
        if last_layer and meta.output_rows is not None:
            rows = meta.output_rows
            if rows.numel() == 0:  # nothing samples: the K/V writes were the work
                return qkv.new_empty((0, hq * self.head_dim)), rows
            assert meta.output_kernel is not None
            qkv, kernel_meta = qkv.index_select(0, rows), meta.output_kernel
        scale = spec.scale if spec is not None and spec.scale is not None else self.head_dim**-0.5
        return paged_attention_fused(self.kernels, qkv, hq, kv_cache, kernel_meta, self.kv_packed, scale), rows

    def supports(self, spec: AttentionLayerSpec) -> bool:
        # The kernel takes any scale; windows and soft-capping are not in it yet.
        return spec.plain


class DenseCausalAttentionBackend(AttentionBackend):
    """One sequence from position 0, no KV cache: causal SDPA over the step's own K/V."""

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.from_numpy(common.slot_mapping))

    def rope_tables(self, rope: RotaryEmbedding, positions: torch.Tensor, max_position: int) -> Any:
        return rope.tables(positions, max_position)

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rope_tables: Any, kv_cache: KVCache | None,
                meta: AttentionMetadata, last_layer: bool,
                spec: AttentionLayerSpec | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = qkv.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_tables
        qk = RotaryEmbedding.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        # 4-D [1, heads, T, D]: with 3-D inputs torch's CPU SDPA takes its slow math path.
        q, k = qk[:, :hq].transpose(0, 1)[None], qk[:, hq:].transpose(0, 1)[None]
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d).transpose(0, 1)[None]
        spec = spec or AttentionLayerSpec()
        if spec.plain:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=spec.scale)
        else:
            idx = torch.arange(t, device=qkv.device)
            mask = idx[None, :] <= idx[:, None]
            if spec.window is not None:
                mask &= idx[None, :] > idx[:, None] - spec.window
            o = eager_attention(q, k, v, mask, spec)
        return o[0].transpose(0, 1).reshape(t, hq * d), None


def select_attention_backend(kernels: ModuleType | None, num_q_heads: int, num_kv_heads: int, head_dim: int,
                             device: torch.device) -> AttentionBackend:
    """The compiled kernels' backend on CPU when they are loaded, else the torch one."""
    if kernels is not None and device.type == "cpu":
        return CpuKernelAttentionBackend(kernels, num_q_heads, num_kv_heads, head_dim, device)
    return TorchAttentionBackend(num_q_heads, num_kv_heads, head_dim, device)
