"""Compiled GGUF kernels (csrc/gguf_kernels.cpp): quantized GEMV/GEMM, dequantization.

Built and cached like the other CPU kernels (tokenloom/model/kernels.py: torch's extension builder,
`-O3 -march=native -fopenmp`, into `<cache>/kernels/gguf_kernels-<key>/`, the key hashing the source,
torch, Python, the flags and the CPU's feature flags), but as their own library so that either source
can change without rebuilding the other. Failures log one warning and return None; callers then
dequantize the weights and run the floating-point path. `TOKENLOOM_CPU_KERNELS=0` turns them off too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from tokenloom.model.kernels import LDFLAGS, _cpu_signature, _import, enabled_by_env

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gguf_kernels.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "module": None}


def gguf_kernels() -> ModuleType | None:
    """The compiled GGUF kernels module, or None when unavailable."""
    if _state["tried"]:
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if not _state["tried"]:
            _state["module"] = _load() if enabled_by_env() else None
            _state["tried"] = True
    return _state["module"]  # type: ignore[return-value]


def _cache_key() -> str:
    import torch

    ident = "|".join([hashlib.sha256(SOURCE.read_bytes()).hexdigest(), torch.__version__, sys.version,
                      " ".join(CFLAGS + LDFLAGS), _cpu_signature()])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _load() -> ModuleType | None:
    try:
        from tokenloom.model.tokenizer import default_cache_dir

        key = _cache_key()
        name = f"tl_gguf_kernels_{key}"
        build_dir = default_cache_dir() / "kernels" / f"gguf_kernels-{key}"
        built = build_dir / f"{name}.so"
        if built.is_file():
            try:
                return _import(name, built)
            except ImportError as exc:
                logger.warning("cached GGUF kernels at %s do not load (%s); rebuilding", built, exc)
        from tokenloom.model.kernels import build_lock

        with build_lock(build_dir):
            if built.is_file():  # another process built it while this one waited
                return _import(name, built)
            return _build(name, build_dir)
    except Exception as exc:  # noqa: BLE001 - any failure means: dequantize instead
        lines = str(exc).strip().splitlines()
        detail = [ln for ln in lines if "error" in ln.lower()][:3] or lines[-1:]
        logger.warning("tokenloom GGUF kernels unavailable (%s: %s); quantized weights will be dequantized",
                       type(exc).__name__, " | ".join(detail))
        return None


def _build(name: str, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    logger.warning("compiling tokenloom's GGUF kernels (first use on this machine, ~20-40 s) into %s", build_dir)
    t0 = time.perf_counter()
    module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                                build_directory=str(build_dir), verbose=False)
    logger.info("GGUF kernels built in %.1f s", time.perf_counter() - t0)
    for entry in build_dir.parent.glob("gguf_kernels-*"):
        if entry != build_dir and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    return module


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    m = gguf_kernels()
    print("GGUF kernels:", "unavailable" if m is None else f"loaded (AVX2 path: {m.has_avx2()})")
