"""Compiled CPU kernels (csrc/cpu_kernels.cpp): built on first use, cached, optional.

The first call to `cpu_kernels()` compiles the C++ source with torch's extension builder
(`-O3 -march=native -fopenmp`; ~10 s on the 2-core dev box) into
`<cache>/kernels/cpu_kernels-<key>/`, where `<cache>` is tokenloom's cache directory
(`$TOKENLOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenloom`, else `~/.cache/tokenloom`) and `<key>`
hashes the source and the headers it includes (csrc/cpu_common.h: helpers it shares with the fused
decoder), the torch and Python versions, the compiler flags and the CPU's feature flags
(the build targets this CPU). Later processes import the cached library directly (~10 ms).
Under TOKENLOOM_CPU_ISA every kernel library builds for the cap's `-march` (haswell for avx2) into
`<stem>_<cap>-<key>/` instead (tokenloom/cpu_isa.py).

Anything that goes wrong (no compiler, no ninja, a compile error, an import error) logs one warning
and returns None: callers then run the pure-torch path, which computes the same thing more slowly.
`TOKENLOOM_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

from tokenloom import cpu_isa, envs
from tokenloom.model.paths import default_cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# -ffp-contract=off: on CPUs without AVX-512 the scalar loops are auto-vectorised, and GCC would
# otherwise fuse a*b + c into one FMA (one rounding instead of two), so results would differ from
# torch's by an ulp on AVX2-only machines; the AVX-512 paths use explicit intrinsics either way.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "module": None, "build_s": None}


def enabled_by_env() -> bool:
    return envs.TOKENLOOM_CPU_KERNELS


def load_once(state: dict[str, object], lock: threading.Lock,
              load: Callable[[], ModuleType | None]) -> ModuleType | None:
    """state["module"], from `load()` on the first call in this process (thread-safe; None when
    TOKENLOOM_CPU_KERNELS turns the kernels off). Shared by the CPU and the GGUF kernels."""
    if not state["tried"]:
        with lock:
            if not state["tried"]:
                state["module"] = load() if enabled_by_env() else None
                state["tried"] = True
    return state["module"]  # type: ignore[return-value]


def cpu_kernels() -> ModuleType | None:
    """The compiled kernels module, or None when unavailable (then use the torch path)."""
    return load_once(_state, _lock, _load)


def build_seconds() -> float | None:
    """Seconds the compile took in this process (None: loaded from the cache, or not built)."""
    return _state["build_s"]  # type: ignore[return-value]


def _cpu_signature() -> str:
    """The CPU's feature flags (cpu_isa reads them once), else its name: the build targets this CPU."""
    if flags := cpu_isa.this_cpu_flags():
        return " ".join(sorted(flags))
    import platform

    return platform.processor() or platform.machine()


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def build_inputs(sources: Sequence[Path]) -> list[Path]:
    """The sources and every header they include with `#include "..."` (found next to the file
    that includes it, transitively): what a build reads, so what its cache key must hash."""
    seen: list[Path] = []
    todo = list(sources)
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_bytes()):
            header = path.parent / name.decode()
            if header.is_file():
                todo.append(header)
    return seen


def _cache_key(sources: Sequence[Path], cflags: list[str], ldflags: list[str]) -> str:
    import torch

    # One source without local headers hashes as it always did (its cached build stays valid).
    inputs = build_inputs(sources)
    digest = "+".join(hashlib.sha256(p.read_bytes()).hexdigest() for p in inputs)
    ident = "|".join([digest, torch.__version__, sys.version, " ".join(cflags + ldflags), _cpu_signature()])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def load_cached_extension(stem: str, source: Path | Sequence[Path], cflags: list[str], ldflags: list[str],
                          what: str) -> tuple[ModuleType, float | None]:
    """Import `source` (one .cpp, or several linked into one library) compiled into
    `<cache>/kernels/<stem>-<key>/`, building it first when missing.

    The key hashes the sources and the headers they include, torch, Python, the flags and the
    CPU's feature flags. Returns the module and the build's seconds (None when it came from the
    cache). Raises on failure: callers log one warning and fall back (the torch path; dequantized
    weights).
    """
    # Under TOKENLOOM_CPU_ISA the build targets the cap's -march instead of this CPU, in an entry of
    # its own (a stale-build sweep of one stem would otherwise delete the other: tokenloom/cpu_isa.py).
    cflags = cpu_isa.capped_cflags(cflags)
    if (cap := cpu_isa.cap_name()) != cpu_isa.NATIVE:
        stem = f"{stem}_{cap}"
    sources = [source] if isinstance(source, Path) else list(source)
    key = _cache_key(sources, cflags, ldflags)
    name = f"tl_{stem}_{key}"
    build_dir = default_cache_dir() / "kernels" / f"{stem}-{key}"
    built = build_dir / f"{name}.so"
    if built.is_file():
        try:
            return _import(name, built), None
        except ImportError as exc:  # a broken cache entry: rebuild it
            logger.warning("cached %s at %s do not load (%s); rebuilding", what, built, exc)
    with build_lock(build_dir):
        if built.is_file():  # another process built it while this one waited
            return _import(name, built), None
        return _build(name, sources, build_dir, cflags, ldflags, what)


def _failure_detail(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    detail = [ln for ln in lines if "error" in ln.lower()][:3] or lines[-1:]
    return f"{type(exc).__name__}: {' | '.join(detail)}"


def _load() -> ModuleType | None:
    try:
        module, _state["build_s"] = load_cached_extension("cpu_kernels", SOURCE, CFLAGS, LDFLAGS, "CPU kernels")
        return module
    except Exception as exc:  # noqa: BLE001 - any failure means: run the torch path
        logger.warning("tokenloom CPU kernels unavailable (%s); using the slower pure-torch path", _failure_detail(exc))
        return None


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Serialise builds of one cache entry across processes, and clear a stale torch build lock.

    torch's builder guards a build with a `lock` file in the build directory; a builder killed
    midway (a test server stopped during its first start, a session ending) leaves it behind, and
    every later build of the same source then waits on it forever. An flock is released by the
    kernel when its holder dies, so whoever holds it knows that any `lock` file left is stale.
    """
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import(name: str, path: Path) -> ModuleType:
    import torch  # noqa: F401 - the library links against torch's; load those first

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, sources: Sequence[Path], build_dir: Path, cflags: list[str], ldflags: list[str],
           what: str) -> tuple[ModuleType, float]:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # The builder runs `ninja` from PATH; pip's ninja lives next to this interpreter, which an
    # unactivated venv does not put on PATH.
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    logger.warning("compiling tokenloom's %s (first use on this machine, ~10-60 s) into %s", what, build_dir)
    t0 = time.perf_counter()
    # Copies: torch's builder appends its own -L/-l flags to the list it is given, which changed the
    # shared LDFLAGS, so the next library built in the same process hashed to another cache key
    # (and a later process, with the pristine flags, rebuilt it and swept the first build away).
    module = cpp_extension.load(name, [str(s) for s in sources], extra_cflags=list(cflags),
                                extra_ldflags=list(ldflags),
                                build_directory=str(build_dir), verbose=False)
    seconds = time.perf_counter() - t0
    logger.info("%s built in %.1f s", what, seconds)
    _remove_stale_builds(build_dir)
    return module, seconds


def _remove_stale_builds(current: Path) -> None:
    """Builds of older sources (or other torch versions) pile up otherwise. A process still using
    one keeps its mapped library: unlinking does not unmap it. A build in progress is left alone
    (its flock is held): another checkout of a different source, a git worktree say, builds its
    own entry beside this one, and removing it midway failed that build."""
    import fcntl

    stem = current.name.rsplit("-", 1)[0]
    for entry in current.parent.glob(f"{stem}-*"):
        if entry == current or not entry.is_dir():
            continue
        with open(entry.parent / f"{entry.name}.flock", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being built right now
            shutil.rmtree(entry, ignore_errors=True)
            fcntl.flock(handle, fcntl.LOCK_UN)


def main() -> int:
    """`python -m tokenloom.model.kernels`: build (or load) the kernels now, e.g. after installing,
    so that the first engine start-up does not pay the compile."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    module = cpu_kernels()
    if module is None:
        print("CPU kernels unavailable (see the warning above); tokenloom runs its pure-torch path")
        return 1
    built = build_seconds()
    elapsed = time.perf_counter() - t0
    how = f"built in {built:.1f} s" if built is not None else f"loaded from the cache in {elapsed:.2f} s"
    print(f"CPU kernels {how}: AVX-512 {module.has_avx512()}, packed bf16 KV layout "
          f"{module.packed_layout_supported(16, 64)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
