"""The compiled kernels are built, and every ISA branch of them compiles, wherever a toolchain exists.

Without these guards a broken kernel source looks like a machine without a compiler: the kernels'
tests skip (about 80 of them for the GGUF kernels) and the engine quietly runs a slower path. And the
`-march=native` build compiles only the branches the CPU in hand has, so the AVX-512, BF16 and VNNI
blocks would never be compiled on an AVX2-only CI machine (`tokenloom/model/isa_check.py`, which
`make test` runs on the shipped sources).
"""

from __future__ import annotations

import shutil

import pytest

from tokenloom.model import gguf_kernels as gguf_kernels_mod
from tokenloom.model import isa_check
from tokenloom.model import kernels as kernels_mod

HAVE_TOOLCHAIN = all(shutil.which(tool) for tool in ("c++", "ninja"))
needs_toolchain = pytest.mark.skipif(not HAVE_TOOLCHAIN or not kernels_mod.enabled_by_env(),
                                     reason="no C++ toolchain (or TOKENLOOM_CPU_KERNELS=0): the torch path is tested")


@needs_toolchain
def test_gguf_kernels_build_where_a_toolchain_exists() -> None:
    assert gguf_kernels_mod.gguf_kernels() is not None, "the GGUF kernels failed to build: see the warning in the log"


@needs_toolchain
def test_isa_check_catches_an_error_in_a_branch_this_cpu_never_compiles(tmp_path) -> None:
    source = tmp_path / "branches.cpp"
    source.write_text(
        "#if defined(__AVX512F__) && defined(__AVX512BW__)\n"
        "static int avx512_only() { return undeclared_name; }\n"  # the planted error
        "#endif\n"
        "int portable() { return 0; }\n"
    )
    failures = isa_check.check([source], ["x86-64-v2", "haswell", "skylake-avx512", "sapphirerapids"],
                               include_flags=[])
    assert sorted(f.target for f in failures) == ["sapphirerapids", "skylake-avx512"]
    assert all("undeclared_name" in f.errors for f in failures)
    source.write_text(source.read_text().replace("undeclared_name", "1"))
    assert isa_check.check([source], ["skylake-avx512"], include_flags=[]) == []


def test_isa_targets_cover_every_branch_the_sources_test() -> None:
    """Each macro the kernel sources branch on is set by at least one target and unset by another, so
    both sides of every `#if` are compiled by the check."""
    import re
    import subprocess

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    macros = set()
    for source in kernels_mod.build_inputs(isa_check.SOURCES):  # the headers too (gguf_quants.h's switches)
        for line in source.read_text().splitlines():
            if line.lstrip().startswith(("#if", "#elif")):
                macros |= set(re.findall(r"__[A-Z0-9_]+__", line))
    assert {"__AVX2__", "__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__", "__AVXVNNI__"} <= macros
    defined: dict[str, set[str]] = {}
    for target in isa_check.TARGETS:
        out = subprocess.run(["c++", f"-march={target}", "-dM", "-E", "-x", "c++", "/dev/null"],
                             capture_output=True, text=True, check=True).stdout
        defined[target] = {m for m in macros if f"#define {m} " in out}
    for macro in macros:
        on = [t for t in isa_check.TARGETS if macro in defined[t]]
        assert on and len(on) < len(isa_check.TARGETS), (macro, on)


def test_the_cache_key_hashes_every_header_a_build_includes(tmp_path) -> None:
    """A header edit must rebuild the extension: gguf_kernels.cpp and fused_decode.cpp share
    gguf_quants.h, and a key over the .cpp files alone would load a stale library after it changed."""
    a, b, c = tmp_path / "a.cpp", tmp_path / "b.h", tmp_path / "c.h"
    a.write_text('#include <vector>\n#include "b.h"\nint f() { return x; }\n')
    b.write_text('#pragma once\n#include "c.h"\n')
    c.write_text("inline int x = 1;\n")
    assert kernels_mod.build_inputs([a]) == [a, b, c]
    key = kernels_mod._cache_key([a], [], [])
    c.write_text("inline int x = 2;\n")  # a header two includes deep
    assert kernels_mod._cache_key([a], [], []) != key
    shipped = kernels_mod.build_inputs(gguf_kernels_mod.SOURCES)
    assert [p.name for p in shipped] == ["gguf_kernels.cpp", "fused_decode.cpp", "gguf_quants.h", "iq_grids.h",
                                        "cpu_common.h"]
    assert [p.name for p in kernels_mod.build_inputs([kernels_mod.SOURCE])] == ["cpu_kernels.cpp", "cpu_common.h"]
