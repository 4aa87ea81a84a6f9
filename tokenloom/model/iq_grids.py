"""Writes csrc/iq_grids.h: the lattice ("grid") tables of the i-quants the GGUF kernels run, from gguf-py.

IQ3_XXS and IQ3_S store each group of four weights as an index into a table of 256 / 512 four-byte
entries (ggml's iq3xxs_grid / iq3s_grid). gguf-py carries the same tables for its numpy dequantizer;
this module unpacks them (gguf.quants' own `init_grid`) into a C header, so the kernels and gguf's
reference read the same numbers. The header is committed; tests/test_gguf_kernels.py checks it is what
this module writes today.

    python -m tokenloom.model.iq_grids      # rewrite tokenloom/model/csrc/iq_grids.h
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import quants

HEADER = Path(__file__).parent / "csrc" / "iq_grids.h"
TABLES = (("kIQ3XXSGrid", quants.IQ3_XXS), ("kIQ3SGrid", quants.IQ3_S))


def grid_words(cls: type) -> list[int]:
    """The type's grid as one little-endian uint32 per entry (its four byte values, first in the low byte)."""
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    assert grid.shape[1] == 4 and grid.min() >= 0 and grid.max() < 128
    return grid.astype(np.uint8).view("<u4").reshape(-1).tolist()


def header_text() -> str:
    lines = [
        "// The i-quants' grid tables (ggml's iq3xxs_grid / iq3s_grid), written by tokenloom/model/iq_grids.py",
        "// from gguf-py's copies: do not edit by hand. Entry i: the four byte values of grid point i, first in",
        "// the low byte.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
    ]
    for name, cls in TABLES:
        words = grid_words(cls)
        lines.append(f"alignas(64) inline constexpr uint32_t {name}[{len(words)}] = {{")
        for i in range(0, len(words), 8):
            lines.append("    " + ", ".join(f"0x{w:08x}" for w in words[i : i + 8]) + ",")
        lines += ["};", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    HEADER.write_text(header_text())
    print(f"wrote {HEADER}")
