"""The compiled LoRA kernel (tokenloom/model/csrc/lora_kernels.cpp) against the exact grouped product.

tests/test_lora.py checks whole models against transformers + peft (the kernel runs there on CPU);
this one drives the corners those tiny models do not reach: shapes that are no multiple of the
kernel's 16/32-column tiles or its 4-rank tiles, groups longer than one 64-row task, scattered rows,
an adapter that targets only some slices of a fused linear (a span of B), one that skips the linear,
float32 and bf16 activations, and bad indices refused instead of read out of bounds.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenloom.lora.models import LoRALinear
from tokenloom.lora.punica import PunicaWrapperCPU
from tokenloom.model.lora_kernels import lora_kernels

KERNEL = lora_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the LoRA kernel could not be built here")

IN = 72  # not a multiple of 16
SLICES = [("q_proj", 40), ("k_proj", 24), ("v_proj", 56)]  # spans cut the 32-column tiles


def _lora(rank: int, fan_in: int, fan_out: int, gen: torch.Generator) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, lora_a=torch.randn(rank, fan_in, generator=gen),
                           lora_b=torch.randn(fan_out, rank, generator=gen), scaling=0.5)


def _adapters(gen: torch.Generator) -> dict[int, SimpleNamespace]:
    """slot -> adapter: all three slices (ranks 6, 5, 3: no multiple of 4), q and v only, none."""
    full = {(0, m): _lora(r, IN, size, gen) for (m, size), r in zip(SLICES, (6, 5, 3), strict=True)}
    q_and_v = {(0, "q_proj"): _lora(8, IN, 40, gen), (0, "v_proj"): _lora(7, IN, 56, gen)}
    return {0: SimpleNamespace(loras=full), 1: SimpleNamespace(loras=q_and_v), 2: SimpleNamespace(loras={})}


def _reference(y: torch.Tensor, x: torch.Tensor, slots: np.ndarray, adapters: dict) -> torch.Tensor:
    """y + each row's adapter delta, slice by slice, in float64."""
    out = y.double().clone()
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        col = 0
        for module, size in SLICES:
            w = adapters[slot].loras.get((0, module))
            if w is not None:
                out[row, col:col + size] += (w.lora_b.double() * w.scaling) @ (w.lora_a.double() @ x[row].double())
            col += size
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "prefill"])
def test_kernel_adds_each_rows_adapter_delta(dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    adapters = _adapters(gen)
    if layout == "decode":  # a few rows per adapter, scattered, base rows between them
        slots = np.array([0, 1, -1, 2, 0, 1, 0, -1, 1])
    else:  # requests' spans: one group longer than a 64-row task, and scattered groups
        slots = np.repeat(np.array([0, 1, -1, 0, 2, 1]), [70, 33, 17, 5, 9, 40])
    punica = PunicaWrapperCPU(torch.device("cpu"), KERNEL)
    linear = LoRALinear(punica, 0, SLICES)
    for slot, adapter in adapters.items():
        linear.set_slot(slot, adapter, dtype, torch.device("cpu"))
    assert 2 not in linear.weights  # the adapter without these modules: a rank-0 group for the kernel
    punica.update_metadata(slots)
    x = torch.randn(len(slots), IN, generator=gen).to(dtype)
    y = torch.randn(len(slots), sum(s for _, s in SLICES), generator=gen).to(dtype)
    want = _reference(y, x, slots, adapters)
    got = punica.add_lora_linear(y.clone(), x, linear.weights)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: y rounded once to 8 bits of mantissa
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    base_rows = torch.from_numpy(slots < 0) | torch.from_numpy(slots == 2)
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows are untouched


def test_kernel_refuses_indices_outside_the_batch() -> None:
    x, y = torch.randn(4, IN), torch.randn(4, 8)
    a, b_t = torch.randn(2, IN), torch.randn(2, 8)
    spans = torch.tensor([[0, 8], [0, 8]])
    KERNEL.lora_shrink_expand(y, x, torch.tensor([0, 3]), torch.tensor([0, 2]), [a], [b_t], [spans])
    with pytest.raises(ValueError, match="a row outside y"):
        KERNEL.lora_shrink_expand(y, x, torch.tensor([0, 4]), torch.tensor([0, 2]), [a], [b_t], [spans])
    with pytest.raises(ValueError, match="span outside"):
        KERNEL.lora_shrink_expand(y, x, torch.tensor([0]), torch.tensor([0, 1]), [a], [b_t],
                                  [torch.tensor([[0, 8], [0, 9]])])
