"""Where tokenloom keeps what it builds or converts on this machine: a leaf module (imports nothing of
tokenloom), so the kernels, the tokenizer and the benchmarks' model set-up share it without an
import circle."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$TOKENLOOM_CACHE_DIR`, else `$XDG_CACHE_HOME/tokenloom`, else `~/.cache/tokenloom`: compiled
    kernels (`kernels/`), converted tokenizers, the benchmarks' real models (`models/`)."""
    if env := os.environ.get("TOKENLOOM_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tokenloom"
