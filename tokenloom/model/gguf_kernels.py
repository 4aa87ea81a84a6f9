"""Compiled GGUF kernels and fused decoder: one extension from two sources.

- csrc/gguf_kernels.cpp: the quant types' traits table, activation quantization, quantized
  GEMV/GEMM tiles, dequantization, and the module's bindings;
- csrc/fused_decode.cpp: `FusedDecoder`, the whole decode step in one call (GGUF or float weights),
  and the dense float / bf16 kernel it runs; it reaches the quantized linears through
  csrc/gguf_quants.h, the two sources' shared header.

Built and cached like the other CPU kernels (tokenloom/model/kernels.py: torch's extension builder,
`-O3 -march=native -fopenmp`, into `<cache>/kernels/gguf_kernels-<key>/`, the key hashing both
sources and the headers they include, torch, Python, the flags and the CPU's feature flags): one
build, one library, one import; its own library so that cpu_kernels.cpp and these can change without
rebuilding each other. Failures log one warning and return None; callers then
dequantize the weights and run the floating-point path. `TOKENLOOM_CPU_KERNELS=0` turns them off too.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

from tokenloom.model.kernels import LDFLAGS, _failure_detail, load_cached_extension, load_once

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "gguf_kernels.cpp", CSRC / "fused_decode.cpp")
# -fvisibility=hidden: the two sources share inline functions (gguf_quants.h, cpu_common.h) and the
# tlq::gguf entry points; with default visibility each is an interposable exported symbol, called
# through the PLT and inlined less, and the split build's decode step ran ~5 % slower than the one-file
# build (FusedDecoder.step, batch 1, 21 alternated rounds); hidden, it is level again. The module's
# PyInit stays exported (pybind11 marks it).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fvisibility=hidden"]

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "module": None}


def gguf_kernels() -> ModuleType | None:
    """The compiled GGUF kernels module, or None when unavailable."""
    return load_once(_state, _lock, _load)


def _load() -> ModuleType | None:
    try:
        module, _ = load_cached_extension("gguf_kernels", SOURCES, CFLAGS, LDFLAGS, "GGUF kernels")
        return module
    except Exception as exc:  # noqa: BLE001 - any failure means: dequantize instead
        logger.warning("tokenloom GGUF kernels unavailable (%s); quantized weights will be dequantized",
                       _failure_detail(exc))
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    m = gguf_kernels()
    paths = "unavailable" if m is None else f"loaded (AVX2 path: {m.has_avx2()}, VNNI dot products: {m.has_vnni()})"
    print("GGUF kernels:", paths)
