"""The compiled LoRA kernel (csrc/lora_kernels.cpp: the shrink/expand of a step's small adapter groups
in one call), built on first use and cached as the CPU kernels are (tokenloom/model/kernels.py).

Optional: when it cannot be built (or TOKENLOOM_CPU_KERNELS=0), the punica wrapper runs its torch
ops, which compute the same deltas.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

from tokenloom.model.kernels import CFLAGS, LDFLAGS, load_cached_extension, load_once

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "lora_kernels.cpp"

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "module": None}


def _load() -> ModuleType | None:
    try:
        module, _ = load_cached_extension("lora_kernels", SOURCE, CFLAGS, LDFLAGS, "LoRA kernel")
        return module
    except Exception as exc:  # noqa: BLE001 - any failure means: run the torch ops
        logger.warning("tokenloom LoRA kernel unavailable (%s: %s); using torch ops", type(exc).__name__, exc)
        return None


def lora_kernels() -> ModuleType | None:
    """The compiled module (`lora_shrink_expand`), or None: use the torch path."""
    return load_once(_state, _lock, _load)
