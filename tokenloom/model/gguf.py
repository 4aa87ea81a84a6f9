"""GGUF files: the header parser, the dequantizers (F32/F16/BF16/Q8_0/Q4_0/Q4_1 here, the other kernel types
through the compiled kernels, the i-quants through gguf's numpy reference), and the mapping of
llama.cpp's tensor names and metadata onto Hugging Face's (`load_gguf` → ModelConfig + weights).

GGUF headers are parsed here rather than with `gguf.GGUFReader`: the reader builds a numpy view per array
element, which costs ~2 s on a 49k-token vocabulary before a single weight is touched. The `gguf` package
still supplies the type enums and block sizes, and its `gguf.quants.dequantize` is the reference the tests
hold our torch dequantizers to (they are bit-identical and ~2.5x faster).
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf_families import (
    BLOCK_NAMES,
    GGUF_ARCHITECTURES,
    ROPE_FACTOR_TENSORS,
    ROPE_PERMUTED,
    family_config_fields,
    finish_family_weights,
    gguf_model_architecture,
)
from tokenloom.model.hf import override_gguf_config
from tokenloom.model.hf_overrides import ModelOverrides, note_dropped_layers

Q = GGMLQuantizationType
logger = logging.getLogger(__name__)
# The types the compiled kernels (or the torch dequantizers) read.
KERNEL_READ_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                     Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_XXS, Q.IQ3_S)
# The types only gguf's numpy reference dequantizes: the i-quants below 3 bits (IQ2_*, IQ1_*), the
# ternary TQ1_0 / TQ2_0 and MXFP4. A file holding them loads with those tensors
# dequantized once, at load: kept as float on the dequantizing path, requantized to Q8_0 on the quantized
# one (gguf_weights.requantize_q8_0). Slower to load and more memory than the file (the loader says so),
# where a refusal would leave the user with nothing.
REFERENCE_ONLY_TYPES = tuple(
    getattr(Q, name) for name in ("IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S",
                                  "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4") if hasattr(Q, name))
SUPPORTED_GGUF_TYPES = KERNEL_READ_TYPES + REFERENCE_ONLY_TYPES


@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy/torch order: GGUF stores dims fastest-first, so reversed
    raw: np.ndarray  # the tensor's bytes (uint8), a view of the memory-mapped file


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over the memory-mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary: ~50k of them twice, tokens and merges), read in one loop
        without the per-element dispatch: a third of the time, on the server's start-up path."""
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out = []
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > len(buf):
                raise struct.error("string runs past the end of the file")
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALAR_FORMATS:
                dtype = np.dtype(_SCALAR_FORMATS[GGUFValueType(etype)])
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            if etype == GGUFValueType.STRING:
                return self._strings(count)
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"corrupt GGUF: unknown metadata value type {vtype}")
        value = self.scalar(_SCALAR_FORMATS[GGUFValueType(vtype)])
        if vtype == GGUFValueType.FLOAT32:
            # The shortest decimal that round-trips in float32 is the value the converter was given
            # (1e-06, not 9.99999997e-07), so GGUF and config.json configs compare equal.
            value = float(str(np.float32(value)))
        return value


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor directory; tensor bytes stay memory-mapped."""
    if os.path.getsize(path) < 24:
        raise ValueError(f"{path} is too small to be a GGUF file")
    with open(path, "rb") as f:
        # ACCESS_COPY gives a writable (copy-on-write) buffer, so torch.from_numpy neither warns nor copies.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    st = os.stat(path)
    metadata, infos, data_start = _parsed_header(os.fspath(path), (st.st_ino, st.st_size, st.st_mtime_ns), buf)
    metadata = dict(metadata)  # the caller's own dict (the values, a vocabulary's lists among them, are shared)
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = {}
    for name, dims, type_id, offset in infos:
        tensors[name] = _tensor_view(path, data, data_start + offset, name, dims, type_id)
    return GGUFFile(metadata=metadata, tensors=tensors)


# The header of a file unchanged on disk is parsed once per process: a load reads it twice (the quantization
# choice, then the weights), and a process that builds engines over one model (tests, a sweep) many times; its
# ~50k-string vocabularies cost ~0.13 s a parse (a digest of the header's bytes, ~2 ms). Keyed by the file's
# identity and mtime and checked against the digest, so a file rewritten in place is read again; the mapped
# tensor bytes are never cached (each load maps the file afresh).
_HeaderInfo = tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]
_HEADERS: OrderedDict[tuple[str, tuple[int, int, int]], tuple[bytes, _HeaderInfo]] = OrderedDict()
_HEADERS_KEPT = 4
_HEADERS_LOCK = threading.Lock()


def _parsed_header(path: str, identity: tuple[int, int, int], buf: mmap.mmap) -> _HeaderInfo:
    """(metadata, tensor directory, where the tensor data starts) of the file mapped as `buf`."""
    key = (path, identity)
    with _HEADERS_LOCK:  # engines load on threads of their own
        kept = _HEADERS.get(key)
    # The header's bytes must be the ones parsed: a timestamp is coarser than a test that rewrites a file in place.
    if kept is not None and len(buf) >= kept[1][2] and _digest(buf, kept[1][2]) == kept[0]:
        with _HEADERS_LOCK:
            if key in _HEADERS:
                _HEADERS.move_to_end(key)
        return kept[1]
    header = _parse_header(path, buf)
    with _HEADERS_LOCK:
        _HEADERS[key] = (_digest(buf, header[2]), header)
        while len(_HEADERS) > _HEADERS_KEPT:
            _HEADERS.popitem(last=False)
    return header


def _digest(buf: mmap.mmap, n: int) -> bytes:
    return hashlib.blake2b(memoryview(buf)[:n], digest_size=16).digest()


def _parse_header(path: str, buf: mmap.mmap) -> _HeaderInfo:
    cur = _Cursor(buf)
    if cur.scalar("<I") != GGUF_MAGIC:
        raise ValueError(f"{path} is not a little-endian GGUF file (bad magic)")
    try:
        metadata, infos = _read_header(cur, path)
    except struct.error:
        raise ValueError(f"{path}: truncated or corrupt GGUF header") from None
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    return metadata, infos, -(-cur.pos // alignment) * alignment


def _read_header(
    cur: _Cursor, path: str | os.PathLike[str]
) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    return metadata, [_read_tensor_info(cur) for _ in range(n_tensors)]


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.scalar("<I")
    dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
    return name, dims, cur.scalar("<I"), cur.scalar("<Q")


def _tensor_view(
    path: str | os.PathLike[str], data: np.ndarray, start: int, name: str, dims: tuple[int, ...], type_id: int
) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has unknown GGML type id {type_id}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(dims, dtype=np.int64))
    nbytes = n_elements // block * type_size
    if n_elements % block or start + nbytes > len(data):
        raise ValueError(f"{path}: tensor {name!r} ({qtype.name}, dims {dims}) does not fit the file")
    return GGUFTensor(name=name, qtype=qtype, shape=tuple(reversed(dims)), raw=data[start : start + nbytes])


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values: float32 for quantized types, the stored dtype for F32/F16/BF16."""
    if tensor.qtype not in SUPPORTED_GGUF_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} has GGML type {tensor.qtype.name}, which tokenloom cannot dequantize; "
            f"supported: {', '.join(t.name for t in SUPPORTED_GGUF_TYPES)}"
        )
    raw = tensor.raw
    if tensor.qtype == Q.F32:
        return torch.from_numpy(raw.view(np.float32)).reshape(tensor.shape)
    if tensor.qtype == Q.F16:
        return torch.from_numpy(raw.view(np.float16)).reshape(tensor.shape)
    if tensor.qtype == Q.BF16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(tensor.shape)
    if tensor.qtype in REFERENCE_ONLY_TYPES:
        from gguf.quants import dequantize as gguf_dequantize

        return torch.from_numpy(gguf_dequantize(raw, tensor.qtype)).float().reshape(tensor.shape)
    if tensor.qtype not in _BLOCK_DEQUANTIZERS:
        return _dequantize_k(tensor)
    blocks = torch.from_numpy(raw).reshape(-1, GGML_QUANT_SIZES[tensor.qtype][1])
    return _BLOCK_DEQUANTIZERS[tensor.qtype](blocks).reshape(tensor.shape)


def _dequantize_k(tensor: GGUFTensor) -> torch.Tensor:
    """Q5_0, Q5_1 and the K-quants: the compiled GGUF kernels' dequantizer (tokenloom/model/
    gguf_kernels.py), else gguf's numpy reference (slower, same values)."""
    from tokenloom.model.gguf_kernels import gguf_kernels

    kernels = gguf_kernels()
    if kernels is None:
        from gguf.quants import dequantize as gguf_dequantize

        return torch.from_numpy(gguf_dequantize(tensor.raw, tensor.qtype)).float().reshape(tensor.shape)
    rows = int(np.prod(tensor.shape[:-1], dtype=np.int64)) if len(tensor.shape) > 1 else 1
    out = torch.empty(rows, tensor.shape[-1])
    kernels.gguf_dequantize(out, torch.from_numpy(tensor.raw).view(rows, -1), int(tensor.qtype))
    return out.reshape(tensor.shape)


def _f16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # ggml packs element j in the low nibble and element j+16 in the high nibble of byte j.
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


# Block layouts (32 values per block), as in ggml-common.h:
#   Q8_0: f16 d, int8 q[32]          -> d * q
#   Q4_0: f16 d, u8 qs[16]           -> d * (nibble - 8)
#   Q4_1: f16 d, f16 m, u8 qs[16]    -> d * nibble + m
_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: lambda b: _f16_column(b, 0) * b[:, 2:].view(torch.int8).float(),
    Q.Q4_0: lambda b: _f16_column(b, 0) * (_nibbles(b[:, 2:]) - 8),
    Q.Q4_1: lambda b: _f16_column(b, 0) * _nibbles(b[:, 4:]) + _f16_column(b, 2),
}

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED = object()
# llama.cpp turns Llama 3 style rope scaling into this tensor of per-frequency divisors.
_GGUF_ROPE_FREQS = "rope_freqs.weight"


def hf_name_from_gguf(name: str, architecture: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (the family's own names
    first: tokenloom/model/gguf_families.py)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    block_names = {**_GGUF_BLOCK_NAMES, **BLOCK_NAMES.get(architecture, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {name!r} for a {architecture} model; tokenloom's loader does not know it")


def note_reference_only_types(gguf: GGUFFile, path: str | os.PathLike[str], kept_as: str,
                              bytes_per_weight: float) -> None:
    """Says, once per load, which tensors only the numpy reference reads (REFERENCE_ONLY_TYPES) and what
    they become at load (`kept_as`: float on the dequantizing path, Q8_0 on the quantized one)."""
    slow = [t for t in gguf.tensors.values() if t.qtype in REFERENCE_ONLY_TYPES]
    if not slow:
        return
    file_mib = sum(t.raw.nbytes for t in slow) / 2**20
    mib = sum(int(np.prod(t.shape, dtype=np.int64)) for t in slow) * bytes_per_weight / 2**20
    logger.warning("%s: %d tensors of GGML type %s have no tokenloom kernel; dequantized by gguf's reference "
                   "and kept as %s (%.0f MiB of weights where the file holds %.0f MiB). Q4_K_M, Q5_K_M, Q6_K and "
                   "Q8_0 files run as they are.", Path(path).name, len(slow),
                   "/".join(sorted({t.qtype.name for t in slow})), kept_as, mib, file_mib)


def load_gguf(path: Path, dtype: torch.dtype,
              overrides: ModelOverrides | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`overrides`: the engine's hf_overrides / disable_sliding_window (tokenloom/model/hf_overrides.py); the
    blocks past an overridden num_hidden_layers are not read."""
    gguf = read_gguf(path)
    note_reference_only_types(gguf, path, str(dtype).removeprefix("torch."), torch.finfo(dtype).bits / 8)
    config = config_from_gguf(gguf, name=path.stem)
    if overrides is not None:
        config = override_gguf_config(config, overrides)
    weights = {}
    dropped = 0
    for name, tensor in gguf.tensors.items():
        if overrides is not None and overrides.drops_gguf_tensor(name, config):
            dropped += 1
            continue
        if name == _GGUF_ROPE_FREQS:
            config.extra["rope_freqs"] = dequantize(tensor).float().clone()
            continue
        if name in ROPE_FACTOR_TENSORS and config.rope_scaling is not None:  # Phi-3 LongRoPE
            kind = "long_factor" if "long" in name else "short_factor"
            config.rope_scaling[kind] = dequantize(tensor).float().tolist()
            continue
        hf_name = hf_name_from_gguf(name, config.architecture)
        value = dequantize(tensor)
        if config.architecture in ROPE_PERMUTED and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            value = unpermute_rope_rows(value, config.num_attention_heads)
        elif config.architecture in ROPE_PERMUTED and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            value = unpermute_rope_rows(value, config.num_key_value_heads)
        weights[hf_name] = value.to(dtype)
    note_dropped_layers(path, config, overrides, dropped)
    return config, finish_family_weights(config, weights)


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` for q/k: per head, interleave the two rotary halves."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `permute_rope_rows`: back to HF's rotate-half row order."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def config_from_gguf(gguf: GGUFFile, name: str = "model") -> ModelConfig:
    """Build a `ModelConfig` from GGUF metadata (and the tensor directory, for vocab size and tying)."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; tokenloom supports {', '.join(GGUF_ARCHITECTURES)}"
        )

    def key(suffix: str, default: Any = _REQUIRED) -> Any:
        full = f"{arch}.{suffix}"
        if default is _REQUIRED and full not in meta:
            raise ValueError(f"GGUF metadata lacks required key {full!r}")
        return meta.get(full, default)

    hidden, heads = key("embedding_length"), key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ValueError("per-layer head counts are not supported")
    head_dim = key("attention.key_length", hidden // heads)
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    if "token_embd.weight" not in gguf.tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    model_arch = gguf_model_architecture(meta, arch)
    family = family_config_fields(meta, arch, model_arch, key("block_count"), head_dim, gguf.tensors)
    return ModelConfig(
        architecture=model_arch,
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=family.pop("rope_scaling", None) or _gguf_rope_scaling(meta, arch),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=name,
        **family,
    )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF-style rope_scaling from llama.cpp's keys (`rope.scale_linear` is the pre-2024 spelling)."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    if (orig := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = orig
    return scaling
