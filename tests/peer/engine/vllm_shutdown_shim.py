# SPDX-License-Identifier: Apache-2.0
"""Stand-ins for the vLLM test helpers its shutdown tests (tests/v1/shutdown) call, for an engine on CPU.

vLLM checks that a deleted or failed engine gave its GPU memory back (`wait_for_gpu_memory_to_clear`). tokenloom's
counterpart of that memory is the engine-core process (which holds the model and the KV cache on CPU) and, in
process, the model object itself: `wait_for_gpu_memory_to_clear` here waits, up to `timeout_s`, until every
engine-core process started during the test has exited and every tokenloom model built during the test is
garbage, and fails naming what is left. The baseline (what was alive before the test) is taken by
`tests/peer/engine/conftest.py`'s `engine_baseline` fixture, so engines other tests keep do not count.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
import weakref
from typing import Any

_baseline: dict[str, set[int]] = {"processes": set(), "models": set()}


def _live_processes() -> dict[int, Any]:
    return {p.pid: p for p in multiprocessing.active_children()}


def _live_models() -> dict[int, Any]:
    from tokenloom.model.decoder_model import DecoderModel

    # type() rather than isinstance(): isinstance asks some of torch's module proxies for __class__, which warns.
    return {id(o): weakref.ref(o) for o in gc.get_objects() if issubclass(type(o), DecoderModel)}


def take_baseline() -> None:
    gc.collect()
    _baseline["processes"] = set(_live_processes())
    _baseline["models"] = set(_live_models())


def wait_for_gpu_memory_to_clear(devices: list[int], threshold_bytes: int, threshold_ratio: float | None = None,
                                 timeout_s: float = 120) -> None:
    """vLLM's check that the engine's memory was given back: here, no engine process and no model of the test's
    still alive (`devices`, `threshold_bytes`, `threshold_ratio` are about GPU memory: nothing to read on CPU)."""
    del devices, threshold_bytes, threshold_ratio
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        processes = {pid: p for pid, p in _live_processes().items() if pid not in _baseline["processes"]}
        models = [ref for key, ref in _live_models().items() if key not in _baseline["models"]]
        if not processes and not models:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:g} s still alive: engine processes "
                                 f"{[p.name for p in processes.values()]}, {len(models)} model(s) of this test")
        time.sleep(0.2)


def create_new_process_for_each_test(method: str | None = None) -> Any:
    """vLLM's decorator runs the test in a fresh process (for its CUDA state); a plain call here."""
    del method
    return lambda fn: fn


class _Platform:
    @staticmethod
    def device_count() -> int:
        """Accelerators, or the one CPU: the model-parallel cases need more devices than that, as in vLLM."""
        import torch

        return max(torch.cuda.device_count(), 1)

    @staticmethod
    def is_cuda() -> bool:
        import torch

        return torch.cuda.is_available()

    @staticmethod
    def is_rocm() -> bool:
        return False


current_platform = _Platform()


def KernelConfig(**options: Any) -> dict[str, Any]:  # noqa: N802 (vLLM's class name)
    """vLLM's KernelConfig as the engine argument tokenloom takes: its options as a dict."""
    return dict(options)
