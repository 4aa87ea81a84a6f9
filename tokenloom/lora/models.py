"""LoRAModelManager: adapters cached on the host and active in slots (vLLM's `lora/models.py` and
`worker_manager.py`'s LRU managers).

Two LRU tiers, as vLLM's:

* the CPU cache (`max_cpu_loras`): adapters read from disk and checked (peft_loader.py), float32;
* the active slots (`max_loras`): adapters whose weights each target linear holds ready for the
  step (`LoRALinear.weights[slot]`): in the run dtype and on the device, the targets a base linear
  fuses (q/k/v, gate/up) stacked so one shrink and one expand serve them all.

The runner calls `set_step` before each forward with every scheduled request's LoRARequest (or None)
and row count: the adapters the step needs are loaded (from the CPU cache, or disk when evicted) and
activated, evicting the least recently used slot the step does not need, and the punica wrapper gets
the slot of every row. The scheduler already keeps a step's distinct adapters to `max_loras` (vLLM's
rule, for the requests it admits); should the running ones exceed it anyway, the step gets a slot more
than `max_loras` for that step rather than failing.

Adding and removing adapters may come from the engine thread while the model thread runs a step
(async scheduling): the CPU cache is guarded by a lock, and slots only change inside `set_step`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import torch

from tokenloom.lora.peft_loader import LoRAModel, load_peft_adapter
from tokenloom.lora.punica import PunicaWrapperCPU
from tokenloom.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class SlotWeights(NamedTuple):
    """One adapter's weights on one base linear, ready for a step."""

    a: torch.Tensor  # [R, in], the run dtype (R: the ranks of the fused slices, stacked)
    b: torch.Tensor  # [out, R], block-diagonal, scaling folded in, the run dtype
    a32: torch.Tensor | None  # float32 copies when the run dtype is not float32 (few-row groups)
    b32: torch.Tensor | None
    a_k: torch.Tensor  # the compiled kernel's layout: A [R, in] and B^T [R, out], float32
    b_t: torch.Tensor
    spans: torch.Tensor  # int64 [R, 2]: the output columns [lo, hi) of each rank column's slice


class LoRALinear:
    """The adapters of one base linear, per active slot. `slices`: the PEFT modules the base linear
    fuses, in its output order, with their output sizes (qkv_proj: q_proj, k_proj, v_proj)."""

    def __init__(self, punica: PunicaWrapperCPU, layer_idx: int, slices: list[tuple[str, int]],
                 input_scale: torch.Tensor | None = None, output_scale: torch.Tensor | None = None) -> None:
        """`input_scale` / `output_scale`: the base linear reads x / input_scale and writes
        y / output_scale (SmoothQuant's folds into int8 layers); the adapter's A and B absorb them."""
        self.punica = punica
        self.layer_idx = layer_idx
        self.slices = slices
        self.input_scale, self.output_scale = input_scale, output_scale
        self.weights: dict[int, SlotWeights] = {}

    def apply(self, out: Any, x: Any, method: Any) -> torch.Tensor:
        """The base linear's output plus this step's adapters' deltas. `out`: the base output (a
        tensor or a method's pending output); `x`: its input in the method's format."""
        y = out if isinstance(out, torch.Tensor) else out.dense()
        return self.punica.add_lora_linear(y, method.dense_input(x), self.weights)

    def set_slot(self, slot: int, adapter: LoRAModel, dtype: torch.dtype, device: torch.device) -> None:
        """Stack the adapter's A of every slice ([R, in], R = sum of ranks) and lay its B out block-
        diagonally ([out, R], scaling folded in), so one shrink and one expand cover the slices."""
        parts = [(adapter.loras.get((self.layer_idx, module)), size) for module, size in self.slices]
        if all(w is None for w, _ in parts):
            self.weights.pop(slot, None)
            return
        total_rank = sum(w.rank for w, _ in parts if w is not None)
        out_features = sum(size for _, size in parts)
        a = torch.cat([w.lora_a for w, _ in parts if w is not None])
        b = torch.zeros(out_features, total_rank)
        spans = torch.empty(total_rank, 2, dtype=torch.int64)
        row = col = 0
        for w, size in parts:
            if w is not None:
                b[row:row + size, col:col + w.rank] = w.lora_b * w.scaling
                spans[col:col + w.rank] = torch.tensor([row, row + size])
                col += w.rank
            row += size
        if self.input_scale is not None:
            a = a * self.input_scale.float()[None, :]
        if self.output_scale is not None:
            b = b / self.output_scale.float()[:, None]
        a32, b32 = a.to(device).contiguous(), b.to(device).contiguous()
        kernel_layout = (a32, b32.t().contiguous(), spans.to(device))
        if dtype == torch.float32:
            self.weights[slot] = SlotWeights(a32, b32, None, None, *kernel_layout)
        else:  # the run dtype for many rows, float32 for few (see PunicaWrapperCPU.add_lora_linear)
            self.weights[slot] = SlotWeights(a.to(device=device, dtype=dtype).contiguous(),
                                             b.to(device=device, dtype=dtype).contiguous(), a32, b32, *kernel_layout)

    def clear_slot(self, slot: int) -> None:
        self.weights.pop(slot, None)


class LoRAModelManager:
    """See the module docstring. `target_shapes`: PEFT module name -> the base linear's (in, out)."""

    def __init__(self, lora_linears: list[LoRALinear], punica: PunicaWrapperCPU, *, num_layers: int,
                 target_shapes: dict[str, tuple[int, int]], max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.lora_linears = lora_linears
        self.punica = punica
        self.num_layers = num_layers
        self.target_shapes = target_shapes
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.dtype, self.device = dtype, device
        self._lock = threading.Lock()
        self._cpu: OrderedDict[int, LoRAModel] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self._active: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.num_loads = 0  # adapters read from disk (a test and the metrics read it)

    # ------------------------------------------------------------------ the CPU cache (any thread)

    def add_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        """Load and check the adapter into the CPU cache (a no-op when cached: its LRU entry is
        refreshed); raises LoRAError saying why an adapter cannot run."""
        lid = lora_request.lora_int_id
        with self._lock:
            cached = self._cpu.get(lid)
            if cached is not None:
                self._cpu.move_to_end(lid)
                return cached
        adapter = load_peft_adapter(lora_request.lora_path, lid, lora_request.lora_name, num_layers=self.num_layers,
                                    target_shapes=self.target_shapes, max_lora_rank=self.max_lora_rank)
        with self._lock:
            self.num_loads += 1
            self._cpu[lid] = adapter
            self._cpu.move_to_end(lid)
            self._evict_cpu(keep=lid)
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d, %d target linears", lora_request.lora_name,
                    lid, lora_request.lora_path, adapter.rank, len(adapter.loras))
        return adapter

    def _evict_cpu(self, keep: int) -> None:
        """Drop least recently used adapters beyond max_cpu_loras; the one just added and active ones
        stay (their slots serve a step that may be running now), the cache exceeding its size until
        they are not."""
        for lid in list(self._cpu):
            if len(self._cpu) <= self.max_cpu_loras:
                break
            if lid != keep and lid not in self._active:
                del self._cpu[lid]

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget the adapter (its slot is freed at the next step). False if it was not loaded."""
        with self._lock:
            return self._cpu.pop(lora_int_id, None) is not None

    def list_adapters(self) -> list[int]:
        with self._lock:
            return list(self._cpu)

    @property
    def active_adapters(self) -> list[int]:
        return list(self._active)

    # ------------------------------------------------------------------ slots (the model thread)

    def set_step(self, lora_requests: list[LoRARequest | None], counts: np.ndarray) -> None:
        """Activate the adapters of this step's requests (one per request, in the batch's row order,
        `counts` rows each) and map every row to its slot."""
        if not any(r is not None for r in lora_requests):
            self.punica.update_metadata(None)
            return
        self._drop_removed()
        needed = list(dict.fromkeys(r.lora_int_id for r in lora_requests if r is not None))
        by_id = {r.lora_int_id: r for r in lora_requests if r is not None}
        slot_of = {lid: self._activate(by_id[lid], needed) for lid in needed}
        slots = np.fromiter((slot_of[r.lora_int_id] if r is not None else -1 for r in lora_requests),
                            dtype=np.int64, count=len(lora_requests))
        self.punica.update_metadata(np.repeat(slots, counts))

    def _drop_removed(self) -> None:
        with self._lock:
            gone = [lid for lid in self._active if lid not in self._cpu]
        for lid in gone:
            self._deactivate(lid)

    def _activate(self, lora_request: LoRARequest, needed: list[int]) -> int:
        lid = lora_request.lora_int_id
        if lid in self._active:
            self._active.move_to_end(lid)
            return self._active[lid]
        if len(self._active) >= self.max_loras:  # free a slot first, so the host cache may drop its adapter
            victim = next((v for v in self._active if v not in needed), None)
            if victim is not None:
                self._deactivate(victim)
            else:
                logger.warning("a step needs more than max_loras=%d adapters; using an extra slot", self.max_loras)
        adapter = self.add_adapter(lora_request)  # from the CPU cache, or disk again after an eviction
        used = set(self._active.values())
        slot = next(s for s in range(len(used) + 1) if s not in used)
        for lin in self.lora_linears:
            lin.set_slot(slot, adapter, self.dtype, self.device)
        self._active[lid] = slot
        return slot

    def _deactivate(self, lid: int) -> None:
        slot = self._active.pop(lid)
        for lin in self.lora_linears:
            lin.clear_slot(slot)
