"""The LoRA product of a flattened batch (vLLM's `punica_wrapper/punica_cpu.py`, SGMV's shape).

One step's rows belong to many requests, each with its adapter or none. Per step the wrapper holds
the slot of every token row (`update_metadata`), and groups the rows by slot once; each target
linear then adds, for every group, `(x[rows] @ A^T) @ B^T` (the shrink to rank r, then the expand
with the scaling folded into B) to the base linear's output rows. The runner lays a request's rows
out together, so a group is usually one contiguous span: a view, no gather. Rows of the base model
(slot -1) are untouched.

The last decoder layer runs attention's output projection and the MLP for the sampling rows only
(tokenloom/model/attention_backends.py `output_rows`): `narrow(rows)` switches the mapping to
those rows for the rest of the step.

On CPU the model room hands in the compiled kernel (tokenloom/model/lora_kernels.py): one call per
linear for all groups, instead of six torch ops per group (gather, cast, shrink, expand, cast,
scatter-add), which at decode sizes cost several times their arithmetic; at prefill sizes it also beats
torch's skinny GEMMs (it skips the zero blocks of a fused linear's B, and never materialises the delta).
Measured per decoder layer in docs/lora.md. Without it (CUDA, TOKENLOOM_CPU_KERNELS=0, no compiler)
the torch ops run every group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# A group's rows: a contiguous span (start, stop), or an index tensor for scattered rows.
Rows = tuple[int, int] | torch.Tensor


def _groups(token_slots: np.ndarray, device: torch.device) -> list[tuple[int, Rows]]:
    """(slot, rows) for each slot present (the base model's -1 left out)."""
    out: list[tuple[int, Rows]] = []
    for slot in np.unique(token_slots):
        if slot < 0:
            continue
        rows = np.flatnonzero(token_slots == slot)
        if rows[-1] - rows[0] + 1 == rows.size:
            out.append((int(slot), (int(rows[0]), int(rows[-1]) + 1)))
        else:
            out.append((int(slot), torch.from_numpy(rows).to(device)))
    return out


class PunicaWrapperCPU:
    """Per-step LoRA mapping and the grouped shrink/expand (runs on CUDA too: plain torch ops).
    `kernel`: the compiled module with `lora_shrink_expand` (CPU only), or None."""

    def __init__(self, device: torch.device, kernel: Any = None) -> None:
        self.device = device
        self.kernel = kernel if device.type == "cpu" else None
        self.token_slots: np.ndarray | None = None
        self.groups: list[tuple[int, Rows]] = []  # (slot, rows) of each adapter in the step
        # For the kernel: the groups' slots, their rows group by group, and where each group starts.
        self.kernel_slots: list[int] = []
        self.kernel_rows: torch.Tensor | None = None
        self.kernel_group_start: torch.Tensor | None = None
        self.num_rows = 0

    @property
    def active(self) -> bool:
        """A row of this step runs an adapter (else the model takes its base-only paths)."""
        return bool(self.groups)

    def update_metadata(self, token_slots: np.ndarray | None) -> None:
        """The slot of every row of the step (-1: the base model); None: no adapter in the step."""
        self.kernel_slots, self.kernel_rows, self.kernel_group_start = [], None, None
        if token_slots is None or not (token_slots >= 0).any():
            self.token_slots, self.groups, self.num_rows = None, [], 0
            return
        self.token_slots = token_slots
        self.groups = _groups(token_slots, self.device)
        self.num_rows = int(token_slots.shape[0])
        if self.kernel is not None:
            self.kernel_slots = [s for s, _ in self.groups]
            self.kernel_rows = torch.cat([torch.arange(*r) if isinstance(r, tuple) else r for _, r in self.groups])
            self.kernel_group_start = torch.tensor(np.cumsum([0] + [_num_rows(r) for _, r in self.groups]))

    def narrow(self, rows: torch.Tensor) -> None:
        """Keep the mapping of these rows only (the last layer's output rows), in their order."""
        if self.token_slots is None or rows.shape[0] == self.num_rows:
            return
        self.update_metadata(self.token_slots[rows.cpu().numpy()])

    # Groups of at most this many rows run the LoRA GEMMs in float32 on a bf16 model: at decode sizes
    # torch's bf16 GEMMs on a CPU without native bf16 cost 3x float32's (135 vs 46 us a linear at one
    # row, SmolLM2's gate_up shape, one thread); from a few dozen rows bf16 wins (563 vs 907 us at 256).
    FLOAT32_MAX_ROWS = 32

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, weights: dict[int, Any]) -> torch.Tensor:
        """y += LoRA(x) for each group, `weights[slot]` = (A [R, in], B [out, R], and their float32
        copies or None) or absent (the slot's adapter does not target this linear). y [T, out], x [T, in],
        both this step's rows."""
        if x.shape[0] != self.num_rows or y.shape[0] != self.num_rows:
            raise RuntimeError(f"LoRA mapping covers {self.num_rows} rows, the linear got {x.shape[0]}")
        if self.kernel_slots and y.dtype in _KERNEL_DTYPES and x.dtype in _KERNEL_DTYPES and y.stride(1) == 1:
            self._kernel_call(y, x if x.stride(1) == 1 else x.contiguous(), weights)
            return y
        for slot, rows in self.groups:  # the torch ops (no kernel; or float16)
            w = weights.get(slot)
            if w is None:
                continue
            n = _num_rows(rows)
            a, b = (w[2], w[3]) if w[2] is not None and n <= self.FLOAT32_MAX_ROWS else (w[0], w[1])
            if isinstance(rows, tuple):
                start, stop = rows
                shrunk = torch.mm(x[start:stop].to(a.dtype), a.t())
                if y.dtype == b.dtype:
                    y[start:stop].addmm_(shrunk, b.t())  # expand and add in one call
                else:
                    y[start:stop] += torch.mm(shrunk, b.t())  # float32 delta into bf16 rows
            else:
                delta = torch.mm(torch.mm(x.index_select(0, rows).to(a.dtype), a.t()), b.t())
                y.index_add_(0, rows, delta.to(y.dtype))
        return y

    def _kernel_call(self, y: torch.Tensor, x: torch.Tensor, weights: dict[int, Any]) -> None:
        a_k, b_t, spans = [], [], []
        for slot in self.kernel_slots:
            w = weights.get(slot)
            if w is None:  # this slot's adapter does not target the linear: a rank-0 group
                a_k.append(_NO_WEIGHT), b_t.append(_NO_WEIGHT), spans.append(_NO_SPANS)
            else:
                a_k.append(w.a_k), b_t.append(w.b_t), spans.append(w.spans)
        self.kernel.lora_shrink_expand(y, x, self.kernel_rows, self.kernel_group_start, a_k, b_t, spans)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_NO_WEIGHT = torch.empty(0, 0)
_NO_SPANS = torch.empty(0, 2, dtype=torch.int64)


def _num_rows(rows: Rows) -> int:
    return rows[1] - rows[0] if isinstance(rows, tuple) else int(rows.shape[0])
