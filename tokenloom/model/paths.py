"""Where tokenloom keeps what it builds or converts on this machine: a leaf module (it imports only
tokenloom.envs), so the kernels, the tokenizer and the benchmarks' model set-up share it without an
import circle."""

from __future__ import annotations

from pathlib import Path

from tokenloom import envs


def default_cache_dir() -> Path:
    """`$TOKENLOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenloom`, else `~/.cache/tokenloom`: compiled
    kernels (`kernels/`), converted tokenizers, the benchmarks' real models (`models/`)."""
    return envs.TOKENLOOM_CACHE_DIR
