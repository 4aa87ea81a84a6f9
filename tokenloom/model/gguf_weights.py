"""GGUF weights kept quantized: `--quantization gguf`.

`load_gguf_quantized` reads a GGUF file like the loader does (same names, same config), except that
every 2-D tensor of a type the GGUF kernels run (tokenloom/model/csrc/gguf_kernels.cpp: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K) stays as its raw blocks, a `GGUFWeight` viewing the memory-mapped file
(q/k rows of llama files are un-permuted, a row permutation of whole blocks, so those two are
copies). Norms, biases and unquantized (F32/F16/BF16) tensors come out as float32 tensors. Memory use
is then about the file's size plus the KV cache, instead of 2-4 bytes per weight.

`GGUFLinear` is the linear layer over such weights (activations quantized to int8 on the fly): for
the 8-row layouts the tile kernel below `gemm_min_rows()` rows and the batched quantized GEMM
(weights converted to int8 chunks on the fly) from there on (prefill); for the row-at-a-time types
the GEMV / small-batch kernel up to `dequant_min_rows() - 1` rows, then dequantize-then-GEMM (see
docs/performance.md for the crossover measurements).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tokenloom import envs
from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf import (
    REFERENCE_ONLY_TYPES,
    GGUFTensor,
    config_from_gguf,
    dequantize,
    hf_name_from_gguf,
    note_reference_only_types,
    read_gguf,
    unpermute_rope_rows,
)
from tokenloom.model.gguf_families import ROPE_FACTOR_TENSORS, ROPE_PERMUTED, finish_family_weights
from tokenloom.model.hf import override_gguf_config
from tokenloom.model.hf_overrides import ModelOverrides, note_dropped_layers

logger = logging.getLogger(__name__)
Q = GGMLQuantizationType
KERNEL_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
                Q.IQ3_XXS, Q.IQ3_S)
_ROPE_FREQS = "rope_freqs.weight"
# The i-quants with a kernel of their own whose decode is compute-bound (a grid lookup per four weights):
# requantized to Q8_0 at load, the same values decode about twice as fast on these CPUs for about twice
# the memory (docs/performance.md, "IQ3 files"). Where that copy would not fit they keep their blocks.
Q8_0_WHEN_IT_FITS = (Q.IQ3_XXS, Q.IQ3_S)


# The crossovers of gemm_min_rows, measured with benchmarks/quant/gguf_prefill_gemm.py --tiles.
GEMM_MIN_ROWS_WIDE = 8  # the GEMM's 512-bit micro-kernel (AVX-512 VNNI)
GEMM_MIN_ROWS_NARROW = 64  # its 256-bit one (AVX2, AVX-VNNI)


def gemm_min_rows(kernels: Any) -> int:
    """Batches of at least this many rows over an 8-row layout run the batched GEMM
    (`gguf_gemm_packed`: weights converted to int8 chunks on the fly, register-blocked micro-kernel)
    instead of the small-batch tile kernel (`gguf_linear_packed`); TOKENLOOM_GGUF_GEMM_ROWS overrides.
    With the 512-bit micro-kernel (AVX-512 VNNI) 8: on a Zen 5 the GEMM is 1.4-2.0x the tile kernel at
    8 rows and about even at 4 (the 0.5B's and 1.5B's linears, 2 threads), and a 32-request server
    decodes 1.15x faster with it. With the 256-bit one 64: on SmolLM2's Q4_1 linears (K = 576 / 1536,
    one thread) the two are even at 32-64 rows (the tile kernel's 4-bit unpack is cheap there); on the
    0.5B's Q5_0 / Q6_K the GEMM is 1.13-1.43x faster at 512 (docs/performance.md)."""
    if envs.TOKENLOOM_GGUF_GEMM_ROWS > 0:
        return envs.TOKENLOOM_GGUF_GEMM_ROWS
    return GEMM_MIN_ROWS_WIDE if _has_wide_gemm(kernels) else GEMM_MIN_ROWS_NARROW


@functools.cache
def _has_wide_gemm(kernels: Any) -> bool:
    """A build's constant, asked once: gemm_min_rows runs for every linear of every batched step."""
    return bool(kernels.has_wide_gemm())


def dequant_min_rows(packed8: bool = False) -> int:
    """Batches of at least this many rows dequantize the weight and run a float GEMM instead of the
    quantized kernel. The row-at-a-time kernel reads its weights once per 4 activation rows: 32
    (TOKENLOOM_GGUF_DEQUANT_ROWS), the crossover measured for it. The 8-row layouts keep a tile in L1
    while all rows pass over it, and stayed ahead of dequantize + fp32 GEMM at every size measured
    (128-token prefill: TTFT 231-253 vs 514-754 ms; 1,024 tokens: 5.4 vs 6.3 s, Q4_1): 4096
    (TOKENLOOM_GGUF_PACKED_DEQUANT_ROWS), above any default step."""
    return envs.TOKENLOOM_GGUF_PACKED_DEQUANT_ROWS if packed8 else envs.TOKENLOOM_GGUF_DEQUANT_ROWS


@dataclass
class GGUFWeight:
    """One GGUF tensor's blocks for a logical [N, K] matrix: `data` uint8 [N, row_bytes] as in the
    file, or with `packed8` the kernels' 8-row interleaved layout [N / 8, ...] (same bytes)."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    packed8: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from tokenloom.model.gguf_kernels import gguf_kernels

        k = gguf_kernels()
        if k is None:
            assert not self.packed8
            from gguf.quants import dequantize as gguf_dequantize

            return torch.from_numpy(gguf_dequantize(self.data.numpy(), Q(self.qtype))).to(dtype)
        out = torch.empty(self.shape, dtype=dtype)
        if self.packed8:
            k.gguf_dequantize_packed(out, self.data, self.qtype)
        else:
            k.gguf_dequantize(out, self.data, self.qtype)
        return out

    def split(self, sizes: list[int]) -> tuple[GGUFWeight, ...]:
        """Row blocks of a fused matrix (Phi-3's qkv_proj / gate_up_proj): views of whole rows, which
        are whole GGUF blocks, so nothing is requantized."""
        if self.packed8 or sum(sizes) != self.shape[0]:
            raise ValueError(f"cannot split a GGUF matrix of {self.shape[0]} rows into {sizes}")
        parts, row = [], 0
        for n in sizes:
            parts.append(GGUFWeight(self.data[row : row + n], self.qtype, (n, self.shape[1])))
            row += n
        return tuple(parts)

    def chunk(self, n: int) -> tuple[GGUFWeight, ...]:
        return self.split([self.shape[0] // n] * n)

    def repacked(self, kernels: object) -> GGUFWeight:
        """The 8-row layout when the kernels have one for this type (every type of KERNEL_TYPES but the IQ3
        types) and the rows come in eights, else self."""
        if self.packed8 or self.shape[0] % 8 or not kernels.gguf_packable(self.qtype):  # type: ignore[attr-defined]
            return self
        data = kernels.gguf_repack8(self.data, self.qtype, self.shape[1])  # type: ignore[attr-defined]
        return GGUFWeight(data, self.qtype, self.shape, packed8=True)


def has_kernel_matrices(path: str | os.PathLike[str]) -> bool:
    """Whether the file has a 2-D tensor of a type the GGUF kernels run, or of one that loads as Q8_0 for
    them (REFERENCE_ONLY_TYPES, requantize_q8_0): a header read, no weights."""
    kept = KERNEL_TYPES + REFERENCE_ONLY_TYPES
    return any(t.qtype in kept and len(t.shape) == 2 for t in read_gguf(Path(path)).tensors.values())


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (/proc/meminfo MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def iq3_as_q8_0(tensors: list[GGUFTensor], path: Path) -> bool:
    """Whether the file's IQ3 matrices (Q8_0_WHEN_IT_FITS) load as Q8_0: TOKENLOOM_GGUF_IQ3_LAYOUT, by
    default `auto`: when the extra memory of that copy is at most half of what is available now."""
    if not tensors:
        return False
    file_bytes = sum(t.raw.nbytes for t in tensors)
    q8_bytes = sum(int(t.shape[0]) * int(t.shape[1]) // 32 * 34 for t in tensors)
    choice = envs.TOKENLOOM_GGUF_IQ3_LAYOUT
    if choice == "auto":
        available = available_memory_bytes()
        as_q8 = available is not None and q8_bytes - file_bytes <= available // 2
    else:
        as_q8 = choice == "q8_0"
    kinds = "/".join(sorted({t.qtype.name for t in tensors}))
    if as_q8:
        logger.info("%s: %d %s matrices requantized to Q8_0 (%.0f MiB where the file holds %.0f MiB): about twice "
                    "as fast to decode; TOKENLOOM_GGUF_IQ3_LAYOUT=blocks keeps the file's blocks", path.name,
                    len(tensors), kinds, q8_bytes / 2**20, file_bytes / 2**20)
    else:
        logger.info("%s: %d %s matrices kept as the file's blocks (%.0f MiB; as Q8_0 they would take %.0f MiB, %s)",
                    path.name, len(tensors), kinds, file_bytes / 2**20, q8_bytes / 2**20,
                    "TOKENLOOM_GGUF_IQ3_LAYOUT=blocks" if choice == "blocks" else "more than half the available memory")
    return as_q8


def load_gguf_quantized(path: str | os.PathLike[str], overrides: ModelOverrides | None = None
                        ) -> tuple[ModelConfig, dict[str, torch.Tensor | GGUFWeight]]:
    """(config, weights) with HF names; quantized 2-D tensors as GGUFWeight, the rest float32. `overrides`: the
    engine's hf_overrides / disable_sliding_window; the blocks past an overridden num_hidden_layers are not read."""
    path = Path(path)
    gguf = read_gguf(path)
    note_reference_only_types(gguf, path, "Q8_0", 34 / 32)  # see requantize_q8_0
    requantized = REFERENCE_ONLY_TYPES
    if iq3_as_q8_0([t for t in gguf.tensors.values() if t.qtype in Q8_0_WHEN_IT_FITS and len(t.shape) == 2], path):
        requantized = REFERENCE_ONLY_TYPES + Q8_0_WHEN_IT_FITS
    config = config_from_gguf(gguf, name=path.stem)
    if overrides is not None:
        config = override_gguf_config(config, overrides)
    weights: dict[str, torch.Tensor | GGUFWeight] = {}
    dropped = 0
    for name, tensor in gguf.tensors.items():
        if overrides is not None and overrides.drops_gguf_tensor(name, config):
            dropped += 1
            continue
        if name == _ROPE_FREQS:
            config.extra["rope_freqs"] = dequantize(tensor).float().clone()
            continue
        if name in ROPE_FACTOR_TENSORS and config.rope_scaling is not None:  # Phi-3 LongRoPE
            kind = "long_factor" if "long" in name else "short_factor"
            config.rope_scaling[kind] = dequantize(tensor).float().tolist()
            continue
        hf_name = hf_name_from_gguf(name, config.architecture)
        heads = None
        if config.architecture in ROPE_PERMUTED and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif config.architecture in ROPE_PERMUTED and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        if tensor.qtype in KERNEL_TYPES and tensor.qtype not in requantized and len(tensor.shape) == 2:
            n, k = tensor.shape
            data = torch.from_numpy(tensor.raw).view(n, -1)
            if heads is not None:
                data = unpermute_rope_rows(data, heads).contiguous()
            weights[hf_name] = GGUFWeight(data, int(tensor.qtype), (n, k))
        elif tensor.qtype in requantized and len(tensor.shape) == 2:
            w = _requantize_q8_0_slabs(tensor)
            if heads is not None:
                w = GGUFWeight(unpermute_rope_rows(w.data, heads).contiguous(), w.qtype, w.shape)
            weights[hf_name] = w
        else:
            value = _dequantize_any(tensor).float()
            if heads is not None:
                value = unpermute_rope_rows(value, heads)
            weights[hf_name] = value.contiguous()
    note_dropped_layers(path, config, overrides, dropped)
    # The family's storage conventions, as the dequantizing loader undoes them (Gemma's 1 + w norms,
    # Qwen3-MoE's stacked experts, which are 3-D and so come out float, Phi-3's fused matrices).
    return config, finish_family_weights(config, weights)  # type: ignore[arg-type]


def requantize_q8_0(value: torch.Tensor) -> GGUFWeight:
    """A float [N, K] matrix as Q8_0 blocks (ggml's arithmetic, as gguf.quants.quantize: per 32 values
    d = max|x| / 127, q = x / d rounded half away from zero, d stored as float16).

    What the types without a tokenloom kernel (IQ3_S, IQ2_*, IQ1_*, TQ1_0 / TQ2_0, MXFP4) become at load
    on the quantized path: their values, dequantized by gguf's reference, kept as Q8_0, which every kernel
    path runs (the tiles, the batched GEMM, the fused step). Their values are a few levels times a
    per-32 (or per-256 x per-32) scale, so Q8_0's 255 steps per 32 values hold them within half a step
    of the block's largest value / 127; the weights take 1.06 bytes each (a quarter of float32's, two to
    four times the file's)."""
    n, k = value.shape
    x = value.float().reshape(n, k // 32, 32)
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    y = x * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = y.abs()
    q = torch.sign(y) * (a.floor() + (2 * (a - a.floor())).floor())  # gguf's np_roundf
    blocks = torch.cat([d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=-1)
    return GGUFWeight(blocks.reshape(n, -1).contiguous(), int(Q.Q8_0), (n, k))


def _requantize_q8_0_slabs(tensor) -> GGUFWeight:  # noqa: ANN001 - a loader GGUFTensor
    """A matrix of a REFERENCE_ONLY_TYPES (or Q8_0_WHEN_IT_FITS) type as Q8_0, a slab of rows at a time: the
    float32 copy of a whole embedding table (and gguf's numpy intermediates beside it) would cost several
    times the model's memory at load."""
    n, k = tensor.shape
    raw = tensor.raw.reshape(n, -1)
    out = torch.empty(n, k // 32 * 34, dtype=torch.uint8)
    for r0 in range(0, n, 1024):
        r1 = min(n, r0 + 1024)
        slab = GGUFTensor(name=tensor.name, qtype=tensor.qtype, shape=(r1 - r0, k), raw=raw[r0:r1])
        out[r0:r1] = requantize_q8_0(dequantize(slab)).data
    return GGUFWeight(out, int(Q.Q8_0), (n, k))


def _dequantize_any(tensor) -> torch.Tensor:  # noqa: ANN001 - a loader GGUFTensor
    if tensor.qtype in KERNEL_TYPES:
        n = 1
        for d in tensor.shape[:-1]:  # every row: a 3-D tensor (Qwen3-MoE's stacked experts) is experts x rows
            n *= d
        w = GGUFWeight(torch.from_numpy(tensor.raw).view(n, -1), int(tensor.qtype), (n, tensor.shape[-1]))
        return w.dequantize().reshape(tensor.shape)
    return dequantize(tensor)


@dataclass
class GGUFLinear:
    """y = x @ W.T + b over GGUF weights; W is the row-concatenation of `parts` (e.g. q, k, v)."""

    parts: list[GGUFWeight]
    bias: torch.Tensor | None  # float32 [N]
    kernels: object | None  # the compiled GGUF kernels module (None: always dequantize)

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].shape[1]

    @classmethod
    def from_weights(cls, parts: list[GGUFWeight], biases: list[torch.Tensor | None],
                     kernels: object | None) -> GGUFLinear:
        """Parts of one GGML type are concatenated into one (one kernel call, one thread split)."""
        merged: list[GGUFWeight] = []
        for p in parts:
            if merged and merged[-1].qtype == p.qtype:
                last = merged[-1]
                rows = last.shape[0] + p.shape[0]
                merged[-1] = GGUFWeight(torch.cat([last.data, p.data]), p.qtype, (rows, p.shape[1]))
            else:
                merged.append(p)
        if kernels is not None:
            merged = [p.repacked(kernels) for p in merged]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.float() if b is not None else torch.zeros(p.shape[0]) for p, b in zip(parts, biases)])
        return cls(merged, bias, kernels)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in `out_dtype` (default: x's). The kernels sum in fp32, so an fp32 output of
        bf16 rows costs nothing more (the LM head's logits keep it: see DecoderModel.compute_logits)."""
        m = x.shape[0]
        out_dtype = x.dtype if out_dtype is None else out_dtype
        # Batch-invariant (the plan's VLLM_BATCH_INVARIANT, which the runner gave the kernels): the quantized
        # GEMV / tile kernel at every row count, no GEMM or dequantizing crossover (docs/reproducibility.md).
        invariant = self.kernels is not None and self.kernels.batch_invariant()
        if self.kernels is None or (not invariant and all(m >= dequant_min_rows(p.packed8) for p in self.parts)):
            w = torch.cat([p.dequantize(x.dtype) for p in self.parts])
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, w, bias).to(out_dtype)
        k = self.kernels
        xf = x.float().contiguous()  # a no-op for fp32 rows
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        col = 0
        for p in self.parts:
            n = p.shape[0]
            bias = None if self.bias is None else self.bias[col : col + n]
            if not invariant and m >= dequant_min_rows(p.packed8):  # this part's float GEMM
                out[:, col : col + n] = F.linear(xf, p.dequantize(torch.float32), bias)
            elif p.packed8 and not invariant and m >= gemm_min_rows(k):
                k.gguf_gemm_packed(out[:, col : col + n], xf, p.data, p.qtype, bias)  # type: ignore[attr-defined]
            elif p.packed8:
                k.gguf_linear_packed(out[:, col : col + n], xf, p.data, p.qtype, bias)  # type: ignore[attr-defined]
            else:
                k.gguf_linear(out[:, col : col + n], xf, p.data, p.qtype, bias)  # type: ignore[attr-defined]
            col += n
        return out if out_dtype == torch.float32 else out.to(out_dtype)
