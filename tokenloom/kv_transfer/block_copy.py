"""A KV block's bytes out of and into the runner's KV tensors, whatever their dtype.

The runner lists every tensor a block lives in with its block axis (`ModelRunner.kv_cache_block_views`:
each layer's K and V today; an int8 KV cache adds its scales tensors there). A block's bytes are the
concatenation, tensor by tensor, of that tensor's slice at the block (`select(axis, block_id)`, in
memory order), so a copy never reinterprets values: float32, bfloat16 (plain or the kernels' packed
layout, which reorders only within a block) and int8 + scales all round-trip bit for bit."""

from __future__ import annotations

import math

import torch


class KVBlockCopier:
    def __init__(self, views: list[tuple[torch.Tensor, int]]) -> None:
        if not views:
            raise ValueError("a KV block copier needs at least one KV tensor")
        self.parts: list[tuple[torch.Tensor, int, int]] = []  # (tensor, block axis, bytes per block)
        for tensor, axis in views:
            per_block = math.prod(s for d, s in enumerate(tensor.shape) if d != axis) * tensor.element_size()
            self.parts.append((tensor, axis, per_block))
        self.block_nbytes = sum(nb for _, _, nb in self.parts)
        self.device = views[0][0].device

    def layout(self) -> list[list]:
        """Each tensor's per-block shape and dtype, for the KV fingerprint."""
        return [[[s for d, s in enumerate(t.shape) if d != axis], str(t.dtype).replace("torch.", "")]
                for t, axis, _ in self.parts]

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """The blocks' bytes into `out` ([len(block_ids), block_nbytes] uint8, on the CPU)."""
        n = len(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        off = 0
        for tensor, axis, nb in self.parts:
            rows = tensor.index_select(axis, idx).movedim(axis, 0).contiguous().reshape(n, -1)
            out[:, off : off + nb] = rows.view(torch.uint8).to("cpu")
            off += nb

    def scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """`data` ([len(block_ids), block_nbytes] uint8) into the blocks."""
        n = len(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        off = 0
        for tensor, axis, nb in self.parts:
            shape = [n] + [s for d, s in enumerate(tensor.shape) if d != axis]
            chunk = data[:, off : off + nb].contiguous().view(tensor.dtype).reshape(shape).movedim(0, axis)
            tensor.index_copy_(axis, idx, chunk.to(self.device))
            off += nb
