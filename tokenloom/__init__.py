"""tokenloom: iteration-level scheduling for LLM inference.

`from tokenloom import LLM, SamplingParams` mirrors `from vllm import LLM, SamplingParams`. The
names load lazily, so importing the pure-Python scheduler core never imports torch.
"""

import os
import sys
from typing import Any

__version__ = "0.1.0"


def _short_openmp_spin() -> None:
    """Idle OpenMP threads spin ~10k iterations, then sleep, unless the user chose a policy.

    libgomp's default long spin starves the one thread a parallel region waits for whenever another
    process wants a core: steps ran 3-8x slower on a loaded 2-core machine, while a short spin keeps
    nearly all of the spin's speed on a quiet one. libgomp reads this once, when torch loads it, so it
    only takes effect if tokenloom is imported before torch (the CLI, the server's engine process,
    `from tokenloom import LLM` first); a user's OMP_WAIT_POLICY / GOMP_SPINCOUNT always wins.
    """
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["GOMP_SPINCOUNT"] = "10000"


def _bounded_onednn_caches() -> None:
    """Cap oneDNN's primitive cache (and ideep's, in front of it) at 64 entries, unless the user set one.

    Pre-packed GEMMs (bf16, and float32 as vLLM does) build one primitive per weight shape and row
    bucket, ~0.5 MiB each with its JIT code and scratchpad; the default cache holds 1,024 of them, so a
    server's RSS climbed for thousands of requests (a 100-request soak of a tiny model: +90 MiB) before
    levelling off. With 64 (vLLM caps each oneDNN GEMM handler at 32) it levels off within the first
    few dozen steps (+45 MiB on the same soak); re-creating an evicted primitive costs about a
    millisecond, against steps of tens. Read when oneDNN first builds a primitive: set here, at import.
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, "64")


def _cap_torch_isa() -> None:
    """Under TOKENLOOM_CPU_ISA (tokenloom/cpu_isa.py), cap torch's own kernels at the same ISA: ATen's
    dispatch and oneDNN's JIT read these once, when torch first picks a kernel, so they are set here,
    before torch loads. A value the user set wins; the plan checks torch ended up within the cap."""
    from tokenloom.cpu_isa import torch_environment

    for name, value in torch_environment().items():
        os.environ.setdefault(name, value)


_short_openmp_spin()
_bounded_onednn_caches()
_cap_torch_isa()

_LAZY = {
    "LLM": "tokenloom.engine.llm",
    "LLMEngine": "tokenloom.engine.llm_engine",
    "AsyncLLM": "tokenloom.engine.async_llm",
    "EngineArgs": "tokenloom.engine.args",
    "AsyncEngineArgs": "tokenloom.engine.args",
    "SamplingParams": "tokenloom.sampling_params",
    "StructuredOutputsParams": "tokenloom.sampling_params",
    "BeamSearchParams": "tokenloom.sampling_params",
    "RequestOutput": "tokenloom.engine.outputs",
    "CompletionOutput": "tokenloom.engine.outputs",
    "PoolingParams": "tokenloom.pooling_params",
    "PoolingRequestOutput": "tokenloom.engine.outputs",
    "EmbeddingRequestOutput": "tokenloom.engine.outputs",
    "ClassificationRequestOutput": "tokenloom.engine.outputs",
    "ScoringRequestOutput": "tokenloom.engine.outputs",
    "TextPrompt": "tokenloom.inputs",
    "TokensPrompt": "tokenloom.inputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenloom' has no attribute {name!r}")


__all__ = list(_LAZY)
