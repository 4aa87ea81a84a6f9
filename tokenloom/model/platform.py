"""Where the model runs: device and dtype resolution, CPU threads, the allocator, loading on one thread.

Threads (CPU): torch intra-op threads = usable cores (oneDNN GEMMs scale with them), inter-op
threads = 1 (nothing runs concurrently); OMP_NUM_THREADS overrides. On an oversubscribed machine
2 OpenMP threads can be much slower than 1 (every op waits at a barrier for a descheduled thread):
give the engine its cores, or set OMP_NUM_THREADS=1. VLLM_CPU_NUM_OF_RESERVED_CPU=N (vLLM's) leaves N
cores out of the model's threads: for async scheduling's engine thread, on a machine with cores to spare.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tokenloom import cpu_isa, envs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_supports_bf16() -> bool:
    """True when bf16 GEMMs have hardware support (AVX512-BF16 or AMX), i.e. oneDNN runs them fast.
    Under TOKENLOOM_CPU_ISA, as a CPU of that level would answer (tokenloom/cpu_isa.py)."""
    if cpu_isa.active_cap() is None and torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX"):
        return True
    flags = cpu_isa.cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_fast_int8() -> bool:
    """True when int8 dot products have hardware support (VNNI or AMX-INT8), which oneDNN's int8 GEMM
    (torch._int_mm, the int8 W8A8 layers) needs to beat float32; without it oneDNN takes a slow path
    (measured on an AVX2-only EPYC: decode 1.7x and prefill ~19x slower than float32). Under
    TOKENLOOM_CPU_ISA, as a CPU of that level would answer."""
    flags = cpu_isa.cpu_flags()
    if not flags:
        return True  # unknown: say nothing
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "float16":
        # vLLM code asks for float16 ("half") to halve the weights; the kernels have no float16 path, so it runs
        # as auto's choice, bfloat16 where the hardware has it (the same 16 bits a value), said once at load.
        chosen = resolve_dtype("auto", device)
        logger.warning("dtype float16 runs as %s here: tokenloom's kernels have no float16 path",
                       str(chosen).removeprefix("torch."))
        return chosen
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or auto")
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reserved_cpus() -> int:
    """vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU: how many usable cores the model's OpenMP threads leave
    to the rest of the process (0 when unset, vLLM's default for one engine). With async scheduling
    the engine thread schedules while the kernels run; a core of its own keeps it from displacing a
    kernel thread, which stalls the whole parallel region at its next barrier (docs/async.md)."""
    return envs.VLLM_CPU_NUM_OF_RESERVED_CPU


def model_threads(usable_cpus: int) -> int:
    """OpenMP threads for the model on `usable_cpus` cores: all of them less the reserved ones."""
    reserved = reserved_cpus()
    if reserved >= usable_cpus:
        raise ValueError(f"{RESERVED_CPU_ENV}={reserved} leaves no core for the model: "
                         f"this process may use {usable_cpus}")  # fmt: skip
    return usable_cpus - reserved


def configure_cpu_threads() -> None:
    """One intra-op thread per usable core (oneDNN GEMMs scale with it), less the cores reserved by
    VLLM_CPU_NUM_OF_RESERVED_CPU; a single inter-op thread, since the forward never runs two ops
    concurrently. OMP_NUM_THREADS, when set, wins."""
    if envs.OMP_NUM_THREADS:
        return
    torch.set_num_threads(model_threads(len(os.sched_getaffinity(0))))
    # Raises once the process has done parallel work; whatever was fixed then stays.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def keep_freed_memory_in_process() -> None:
    """Stop glibc from handing multi-MB activations back to the kernel after every op.

    By default glibc serves large allocations with fresh mmaps (and trims the heap on free), so
    each step's big temporaries (gathered K/V, MLP activations) page-fault again on every layer:
    on this VM that cost up to 3x on an fp32 decode step. Pinning the mmap threshold at its
    maximum (32 MiB) and disabling trimming keeps them in the heap. vLLM's CPU docs recommend
    preloading tcmalloc for the same reason; this needs no preload. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel once (glibc's malloc_trim): after pre-packing,
    the plain weights just replaced by oneDNN's copies (~540 MB for the default model in float32)
    would otherwise stay in the process's RSS, since trimming is off (`keep_freed_memory_in_process`).
    No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one thread. Dequantizing and casting are memory-bound elementwise ops: a second thread
    saves little on an idle machine, while on a busy one OpenMP's spin-waiting made loading 5-10x slower
    (SmolLM2: 0.8-1.7 s on one thread vs 5-14 s on two, with other jobs running)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
